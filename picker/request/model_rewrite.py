"""Model rewrites (llm-d's InferenceModelRewrite): a request whose ``model`` a rule matches is sent on as one of the
rule's weighted targets, for canaries and aliases. Applied in the parse stage, before the response cache keys the
request and before Tier 4 keys its blocks, so both see the model the engine serves; the body sent upstream carries
it too. See docs/llm-d-compat.md, "InferenceModelRewrite".

Precedence (llm-d's, with the config's rewrites counted as older than every watched object): an exact match beats
a generic rule (no ``matches``); among several exact matches, or several generic rules, the config's rewrites in
list order come first, then the watched objects from the oldest (``metadata.creationTimestamp``, then name); inside
one rewrite the first rule in list order wins. A target is drawn per request, not per session (as llm-d), but not
at random: each rule walks a golden-ratio sequence from a random start (``RewriteChoice.draw``), so its targets'
shares are their weights to within a few requests at any count, where llm-d's random draw strays by its standard
deviation (about 1% of 1,000 requests at 90/10).
"""

from __future__ import annotations

import logging
import random
import re
from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter

from picker.config import ModelRewriteConfig
from picker.facts import RequestFacts
from picker.ops.llmd import MAX_MODEL_LABELS, BoundedLabel
from picker.shared.discovery.kube_objects import ModelRewrite, RewriteRule, RewriteTarget

log = logging.getLogger("kv_epp.request")

# the top-level "model" key and its string value, as clients write it (the value's span is replaced in place)
_MODEL_MEMBER = re.compile(rb'"model"\s*:\s*("(?:[^"\\]|\\.)*")')
_WS = b" \t\r\n"
_GOLDEN = (5**0.5 - 1) / 2  # the golden ratio's fraction: the step of the draw's low-discrepancy sequence


@dataclass(frozen=True, slots=True)
class RewriteChoice:
    """A matched rule's targets, ready to draw from: ``cumulative`` weights (an unweighted target of a weighted
    rule weighs 0, as in llm-d; a rule with no weights is an even split)."""

    rewrite: str  # the InferenceModelRewrite's name
    source: str  # "config" or "watched"
    models: tuple[str, ...]
    cumulative: tuple[int, ...]
    # the rule's point in [0, 1) on its golden-ratio sequence (mutable state, not part of the rule's identity);
    # negative until the first draw places it at random
    _point: list[float] = field(default_factory=lambda: [-1.0], compare=False, repr=False)

    @classmethod
    def of(cls, rewrite: str, source: str, targets: Sequence[RewriteTarget]) -> RewriteChoice:
        weighted = any(t.weight is not None for t in targets)
        total, cumulative = 0, []
        for t in targets:
            total += (t.weight or 0) if weighted else 1
            cumulative.append(total)
        return cls(rewrite, source, tuple(t.model for t in targets), tuple(cumulative))

    def draw(self, rng: random.Random) -> str:
        """The next target: the rule's point advances by the golden ratio's fraction (mod 1) and falls in a target's
        share of [0, 1) (weight / total); any n consecutive draws give each target its share to within a few
        draws (a low-discrepancy sequence), in an order that does not repeat. The start is random (``rng``)."""
        p = self._point
        p[0] = rng.random() if p[0] < 0.0 else (p[0] + _GOLDEN) % 1.0
        total = self.cumulative[-1]
        return self.models[bisect_right(self.cumulative, min(int(p[0] * total), total - 1))]


@dataclass(frozen=True, slots=True)
class RewriteTable:
    """The merged rules, built once per change (config reload, watch publication): the request does one dict
    lookup. Bounded by what it is built from (the config's ``model_rewrites``; the watch's MAX_MODEL_REWRITES)."""

    exact: Mapping[str, RewriteChoice]
    generic: RewriteChoice | None

    def match(self, model: str) -> RewriteChoice | None:
        return self.exact.get(model) or self.generic

    @classmethod
    def build(cls, configured: Sequence[ModelRewrite], watched: Iterable[ModelRewrite]) -> RewriteTable:
        ordered = [(rw, "config") for rw in configured]
        ordered += [(rw, "watched") for rw in sorted(watched, key=lambda rw: (rw.created or 0.0, rw.name))]
        exact: dict[str, RewriteChoice] = {}
        generic: RewriteChoice | None = None
        for rw, source in ordered:
            for rule in rw.rules:
                if not rule.targets:  # refused by the config and the watch's parse: never drawn from
                    continue
                choice = RewriteChoice.of(rw.name, source, rule.targets)
                if not rule.models and generic is None:
                    generic = choice
                for m in rule.models:
                    exact.setdefault(m, choice)
        return cls(exact, generic)


EMPTY = RewriteTable({}, None)


def from_config(cfg: ModelRewriteConfig) -> ModelRewrite:
    """A config entry as the watch's value type (no creation time: it ranks before every watched object)."""
    rules = tuple(
        RewriteRule(
            tuple(dict.fromkeys(m.model.value for m in r.matches)),
            tuple(RewriteTarget(t.model_rewrite, t.weight) for t in r.targets),
        )
        for r in cfg.rules
    )
    return ModelRewrite(cfg.name, rules, None)


def rewrite_body(body: bytes, old: str, new: str, data: Mapping[str, Any]) -> tuple[bytes, str] | None:
    """``body`` with its top-level ``model`` set to ``new``, and how: ``spliced`` (the value's bytes replaced in
    place, the rest byte-identical: the one ``"model"`` in the body is a member whose value is ``old``), else
    ``reserialized`` (``data``, the parsed body, written again with orjson: same JSON, other spacing). None when it
    cannot be written (nested deeper than orjson writes)."""
    if body.count(b'"model"') == 1:
        m = _MODEL_MEMBER.search(body)
        if m is not None and body[: m.start()].rstrip(_WS)[-1:] in (b"{", b","):
            try:
                same = orjson.loads(m.group(1)) == old
            except orjson.JSONDecodeError:
                same = False
            if same:
                return body[: m.start(1)] + orjson.dumps(new) + body[m.end(1) :], "spliced"
    try:
        return orjson.dumps({**data, "model": new}), "reserialized"
    except (TypeError, orjson.JSONEncodeError):
        return None


class ModelRewrites:
    """The request path's model rewriting: the config's rewrites (``configure``, at start and at each reload) and
    the watched InferenceModelRewrites (``watched``, replaced by the watch), merged into one ``RewriteTable``, and
    the counters ``llm_d_epp_model_rewrite_decisions_total{model_rewrite_name, model_name, target_model}`` (with its
    GIE-era alias ``inference_extension_model_rewrite_decisions_total``) and ours,
    ``kv_epp_model_rewrites_total{source, body}``. ``rng``: tests pass a seeded one."""

    def __init__(
        self, registry: CollectorRegistry, rng: random.Random | None = None, model_labels: BoundedLabel | None = None
    ) -> None:
        self._rng = rng or random.Random()
        self._configured: tuple[ModelRewrite, ...] = ()
        self._watched: dict[str, ModelRewrite] = {}
        self.table = EMPTY
        labels = ("model_rewrite_name", "model_name", "target_model")
        help_text = "Model-rewrite decisions (InferenceModelRewrite): a request's model_name sent on as target_model"
        self.decisions = Counter("llm_d_epp_model_rewrite_decisions", help_text, labels, registry=registry)
        self.decisions_gie = Counter(
            "inference_extension_model_rewrite_decisions", "[Deprecated: use llm_d_epp_model_rewrite_decisions_total] "
            + help_text, labels, registry=registry,
        )  # fmt: skip
        self.ours = Counter(
            "kv_epp_model_rewrites", "Requests whose model a rewrite matched, by where the rewrite came from "
            "(config, watched) and what became of the body (spliced, reserialized, unchanged: the target was the "
            "request's model, unwritable: not rewritten)", ("source", "body"), registry=registry,
        )  # fmt: skip
        # a generic rule's request models as labels: llm-d's request families' model_name cap, shared with them (a
        # model is the same label in both); a private one when none is given (tests)
        self._labels = model_labels if model_labels is not None else BoundedLabel(MAX_MODEL_LABELS)
        # told the rules' model names at each change (llm-d's request families keep them out of their label cap)
        self.on_change: Callable[[RewriteTable], None] | None = None

    @property
    def active(self) -> bool:
        return self.table is not EMPTY

    @property
    def watched(self) -> dict[str, ModelRewrite]:
        return self._watched

    @watched.setter
    def watched(self, rewrites: dict[str, ModelRewrite]) -> None:
        """What the InferenceModelRewrite watch publishes (``{name: rewrite}``, a new dict at each change)."""
        self._watched = rewrites
        self._rebuild()

    def configure(self, rewrites: Sequence[ModelRewriteConfig]) -> None:
        """The config's ``model_rewrites`` (hot-reloadable)."""
        self._configured = tuple(from_config(c) for c in rewrites)
        self._rebuild()

    def _rebuild(self) -> None:
        table = RewriteTable.build(self._configured, self._watched.values())
        table = table if table.exact or table.generic is not None else EMPTY
        if table == self.table:  # a reload that left the rules as they were: nothing to say
            return
        self.table = table
        if self.on_change is not None:
            self.on_change(table)
        log.info(
            "event=model_rewrites_changed configured=%d watched=%d exact_models=%d generic=%s",
            len(self._configured), len(self._watched), len(table.exact),
            table.generic.rewrite if table.generic is not None else None,
        )  # fmt: skip

    def apply(
        self, facts: RequestFacts, data: dict[str, Any] | None, body: bytes | None
    ) -> tuple[RequestFacts, dict[str, Any], bytes] | None:
        """The request rewritten (its facts with the served model, the parsed body with it, the body to send
        upstream), or None: no rule matches, no body (a request routed at its headers is not rewritten), the drawn
        target is the request's own model, or the body cannot be written (counted ``unwritable``)."""
        model = facts.model
        if model is None or data is None or body is None:
            return None
        choice = self.table.match(model)
        if choice is None:
            return None
        target = choice.draw(self._rng)
        label = model if model in self.table.exact else self._labels.bound(model)
        self.decisions.labels(choice.rewrite, label, target).inc()
        self.decisions_gie.labels(choice.rewrite, label, target).inc()
        if target == model:
            self.ours.labels(choice.source, "unchanged").inc()
            return None
        written = rewrite_body(body, model, target, data)
        if written is None:
            self.ours.labels(choice.source, "unwritable").inc()
            log.warning("event=model_rewrite_unwritable rewrite=%s model=%r", choice.rewrite, model[:128])
            return None
        new_body, how = written
        self.ours.labels(choice.source, how).inc()
        return replace(facts, model=target, body_bytes=len(new_body)), {**data, "model": target}, new_body

    def stats(self) -> dict[str, object]:
        """``/admin/model-rewrites``: the rewrites in force and what each exact model (and the generic rule) maps
        to, in precedence order."""

        def shown(c: RewriteChoice) -> dict[str, object]:
            weights = [b - a for a, b in zip((0, *c.cumulative), c.cumulative, strict=False)]
            return {"rewrite": c.rewrite, "source": c.source, "targets": dict(zip(c.models, weights, strict=True))}

        t = self.table
        return {
            "configured": [rw.name for rw in self._configured],
            "watched": sorted(self._watched),
            "exact": {m: shown(c) for m, c in list(t.exact.items())[:1000]},
            "exact_models": len(t.exact),
            "generic": shown(t.generic) if t.generic is not None else None,
        }


__all__ = ["MAX_MODEL_LABELS", "ModelRewrites", "RewriteChoice", "RewriteTable", "from_config", "rewrite_body"]
