"""Model rewrites (llm-d's InferenceModelRewrite) on the request path, without Envoy: the precedence between config
and watched rules, the weighted draw, the body sent upstream (spliced in place, or written again), the metrics,
and the 90/10 canary whose canary requests Tier 4 keys with the canary model (a real ``Tier4``, token-id prompts:
no tokenizer). The same through the real Envoy: tests/integration/test_model_rewrite_envoy.py."""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from picker.config import config_warnings, parse_settings
from picker.facts import Answer, RequestFacts
from picker.kv.stage import KvLookup
from picker.kv.tier4 import Tier4
from picker.request.exchange import Exchange
from picker.request.model_rewrite import MAX_MODEL_LABELS, ModelRewrites, RewriteTable, from_config, rewrite_body
from picker.request.path import Inbound
from picker.runtime.app import PickerApp
from picker.shared.block_keys import chain_block_keys, root_key
from picker.shared.config_files import ConfigError
from picker.shared.discovery.kube_objects import ModelRewrite, RewriteRule, RewriteTarget
from tests.support.builders import BACKENDS, CHAT, app_of

COMPLETIONS = "/v1/completions"


def rule(models: tuple[str, ...], *targets: tuple[str, int | None]) -> RewriteRule:
    return RewriteRule(models, tuple(RewriteTarget(m, w) for m, w in targets))


def watched(name: str, created: float, *rules: RewriteRule) -> ModelRewrite:
    return ModelRewrite(name, rules, created)


def configured(name: str, *rules: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "rules": list(rules)}


def exact(model: str, *targets: tuple[str, int | None]) -> dict[str, Any]:
    return {
        "matches": [{"model": {"type": "Exact", "value": model}}],
        "targets": [{"modelRewrite": m, **({"weight": w} if w is not None else {})} for m, w in targets],
    }


def sample(app: PickerApp, name: str, labels: dict[str, str]) -> float | None:
    return app.metrics.registry.get_sample_value(name, labels)


# -- precedence ---------------------------------------------------------------------------------------------------


def test_exact_beats_generic_then_config_then_oldest_then_first_rule() -> None:
    config = [
        from_config(
            parse_settings({"model_rewrites": [configured("cfg", exact("a", ("from-config", None)))]}).model_rewrites[0]
        )
    ]
    objects = [
        watched("young", 200.0, rule((), ("young-generic", None)), rule(("a", "b"), ("young-b", None))),
        watched("old", 100.0, rule(("b",), ("old-b1", None)), rule(("b", "c"), ("old-b2", None)), rule((), ("g", 1))),
        watched("same-age-z", 300.0, rule(("d",), ("z", None))),
        watched("same-age-a", 300.0, rule(("d",), ("a-wins", None))),
    ]
    table = RewriteTable.build(config, objects)
    picked = {m: table.match(m) for m in ("a", "b", "c", "d", "zzz")}
    assert {m: (c.rewrite, c.models) for m, c in picked.items() if c is not None} == {
        "a": ("cfg", ("from-config",)),  # the config's rewrite counts as older than any object
        "b": ("old", ("old-b1",)),  # the oldest object, its first matching rule
        "c": ("old", ("old-b2",)),
        "d": ("same-age-a", ("a-wins",)),  # same creation time: by name
        "zzz": ("old", ("g",)),  # no exact match: the oldest generic rule (an exact match elsewhere beats it)
    }
    assert picked["a"] is not None and picked["a"].source == "config" and picked["b"] is not None
    assert picked["b"].source == "watched"


def test_weights_draw_in_proportion_unweighted_split_evenly_and_mixed_leave_the_unweighted_out() -> None:
    rng = random.Random(7)
    table = RewriteTable.build(
        [],
        [
            watched("w", 1.0, rule(("m",), ("v1", 3), ("v2", 1))),
            watched("even", 2.0, rule(("e",), ("x", None), ("y", None))),
            watched("mixed", 3.0, rule(("x",), ("never", None), ("always", 5))),
        ],
    )
    n = 8000

    def draws(model: str) -> Counter[str]:
        choice = table.match(model)
        assert choice is not None
        return Counter(choice.draw(rng) for _ in range(n))

    w, even, mixed = draws("m"), draws("e"), draws("x")
    assert abs(w["v1"] / n - 0.75) < 0.03 and w["v1"] + w["v2"] == n
    assert abs(even["x"] / n - 0.5) < 0.03
    assert mixed == {"always": n}  # llm-d: a target without a weight in a weighted rule is never selected


@pytest.mark.parametrize("seed", range(20))
def test_every_run_of_draws_gives_each_target_its_share_within_a_few_requests(seed: int) -> None:
    """The golden-ratio draw from any random start: at 90/10 and 1/2/7, every prefix of 2,000 consecutive draws
    gives each target its weight's share to within 3 requests (a random draw strays by sqrt(n p (1 - p)): about
    9 of 1,000 at 90/10)."""
    rng = random.Random(seed)
    for targets in ((("v1", 90), ("v2", 10)), (("a", 1), ("b", 2), ("c", 7))):
        choice = RewriteTable.build([], [watched("w", 1.0, rule(("m",), *targets))]).match("m")
        assert choice is not None
        total = sum(w for _, w in targets)
        seen: Counter[str] = Counter()
        for i in range(1, 2001):
            seen[choice.draw(rng)] += 1
            assert all(abs(seen[t] - i * w / total) <= 3 for t, w in targets), (seed, i, seen)


# -- the body -----------------------------------------------------------------------------------------------------


def test_the_body_keeps_every_byte_but_the_models_value_when_the_model_key_is_unique() -> None:
    sent = b'{"model" : "stable",\n  "messages": [{"role": "user", "content": "caf\\u00e9 \\"model\\""}], "n": 1.0}'
    out = rewrite_body(sent, "stable", "canary-\u00e9", orjson.loads(sent))
    assert out is not None
    body, how = out
    assert how == "spliced"
    assert body == sent.replace(b'"stable"', orjson.dumps("canary-\u00e9"))
    assert json.loads(body)["model"] == "canary-\u00e9"


@pytest.mark.parametrize(
    "sent",
    [
        b'{"tools": [{"model": "stable"}], "model": "stable"}',  # a second "model" key, nested
        b'{"mod\\u0065l": "stable", "x": 1}',  # the key spelled with an escape
        b'{"model": "stab\\u006ce"}',  # the value spelled with an escape: still the same model
        b'{"messages": [{"role": "model", "content": "q"}], "model": "stable"}',  # "model" as a value too
    ],
)
def test_otherwise_the_parsed_body_is_written_again_with_the_new_model(sent: bytes) -> None:
    data = orjson.loads(sent)
    out = rewrite_body(sent, "stable", "canary", data)
    assert out is not None
    body, how = out
    assert orjson.loads(body) == {**data, "model": "canary"}
    assert how == ("spliced" if b"\\u006c" in sent else "reserialized")


def test_a_body_too_deep_to_write_again_is_not_rewritten_and_counted() -> None:
    app = app_of({"pool": {"backends": BACKENDS}, "model_rewrites": [configured("r", exact("m", ("t", None)))]})
    deep = (
        b'{"model": "m", "model_x": "model", "messages": [{"role": "user", "content": "q"}], "x": '
        + (b"[" * 300 + b"]" * 300)
        + b"}"
    )  # orjson reads 1,024 levels but writes 255: no splice (two "model"), no rewrite
    facts = RequestFacts(api="chat", model="m")
    assert app.path.rewrites.apply(facts, orjson.loads(deep), deep) is None
    assert sample(app, "kv_epp_model_rewrites_total", {"source": "config", "body": "unwritable"}) == 1


# -- the request path ---------------------------------------------------------------------------------------------


def canary_app(**extra: Any) -> PickerApp:
    return app_of(
        {
            "selection_strategy": "PrefixAwareHash",
            "prefix_routing": {"enabled": True},
            "pool": {"backends": BACKENDS},
            "kv_cache_index": {
                "enabled": True,
                "tokenizer": {"source": "none"},
                "lora_adapters": {"adapter-v1": "base", "adapter-v2": "base"},
            },
            "model_rewrites": [configured("canary", exact("adapter", ("adapter-v1", 90), ("adapter-v2", 10)))],
        }
        | extra
    )


class RecordingHolds:
    """The real Tier 4 (its ``lookup`` keys the request) with a record of the model and block keys of each lookup."""

    def __init__(self, tier4: Tier4) -> None:
        self.tier4 = tier4
        self.seen: list[tuple[str | None, tuple[int, ...]]] = []

    async def lookup(self, facts: RequestFacts) -> KvLookup:
        got = await self.tier4.lookup(facts)
        self.seen.append((facts.model, tuple(got.block_keys)))
        return got

    def page_tokens(self, backend: str) -> int | None:
        return self.tier4.page_tokens(backend)


async def test_a_90_10_rewrite_sends_10_percent_to_the_canary_and_tier4_keys_them_with_it() -> None:
    app = canary_app()
    assert app.tier4 is not None and app.path.tier4
    holds = RecordingHolds(app.tier4)
    app.path.holds = holds
    app.path.rewrites._rng = random.Random(25)  # the draw is per request (llm-d's): seeded, the test is exact
    ids = list(range(100, 164))  # 4 blocks of 16 token ids
    upstream: Counter[str] = Counter()
    for i in range(1000):
        sent = json.dumps({"model": "adapter", "prompt": ids, "max_tokens": 1, "user": f"u{i}"}).encode()
        ex = await app.path.route(Inbound(COMPLETIONS, {":method": "POST"}, sent))
        assert isinstance(ex, Exchange) and ex.body_out is not None
        out = json.loads(ex.body_out)
        assert out == {**json.loads(sent), "model": ex.facts.model}  # the body upstream carries the served model
        upstream[out["model"]] += 1
        ex.end(completed=True)
    assert 70 <= upstream["adapter-v2"] <= 130 and upstream["adapter-v1"] + upstream["adapter-v2"] == 1000
    max_blocks = app.tier4.max_blocks
    want = {m: chain_block_keys(ids, 16, root_key("base", m, None), max_blocks) for m in ("adapter-v1", "adapter-v2")}
    assert want["adapter-v1"] != want["adapter-v2"]
    assert Counter(m for m, _ in holds.seen) == upstream  # Tier 4 looked every request up with its served model
    for model, keys in holds.seen:
        assert model is not None and list(keys) == list(want[model])  # the canary's blocks: the canary's root
    labels = {"model_rewrite_name": "canary", "model_name": "adapter"}
    assert (
        sample(app, "llm_d_epp_model_rewrite_decisions_total", labels | {"target_model": "adapter-v2"})
        == (upstream["adapter-v2"])
    )
    gie = sample(app, "inference_extension_model_rewrite_decisions_total", labels | {"target_model": "adapter-v1"})
    assert gie == upstream["adapter-v1"]
    assert sample(app, "kv_epp_model_rewrites_total", {"source": "config", "body": "spliced"}) == 1000


async def test_the_response_cache_keys_the_served_model_and_an_unmatched_model_is_left_alone() -> None:
    app = canary_app(response_cache={"enabled": True})
    app.path.rewrites._rng = random.Random(1)
    seen: list[str | None] = []
    lookup = app.path.cache.lookup if app.path.cache is not None else None
    assert lookup is not None

    async def spy(facts: RequestFacts, *args: Any, **kwargs: Any) -> Any:
        seen.append(facts.model)
        assert kwargs["data"]["model"] == facts.model  # the key's body fields agree with the served model
        return await lookup(facts, *args, **kwargs)

    app.path.cache.lookup = spy  # type: ignore[union-attr,method-assign]
    body = {"model": "adapter", "messages": [{"role": "user", "content": "q"}], "temperature": 0}
    ex = await app.path.route(Inbound(CHAT, {":method": "POST"}, json.dumps(body).encode()))
    assert isinstance(ex, Exchange) and seen == [ex.facts.model] and ex.facts.model in ("adapter-v1", "adapter-v2")
    ex.end(completed=True)
    other = json.dumps({**body, "model": "base"}).encode()
    ex = await app.path.route(Inbound(CHAT, {":method": "POST"}, other))
    assert isinstance(ex, Exchange) and ex.facts.model == "base" and ex.body_out is None  # unchanged, not rewritten
    ex.end(completed=True)


async def test_a_request_routed_at_its_headers_is_not_rewritten() -> None:
    app = canary_app()
    ex = await app.path.route(Inbound(CHAT, {":method": "POST"}, None))
    assert isinstance(ex, Exchange) and ex.facts.model is None and ex.body_out is None
    assert sample(app, "kv_epp_model_rewrites_total", {"source": "config", "body": "spliced"}) is None


async def test_a_reload_changes_the_rules_and_the_anthropic_injection_marks_the_rewritten_body() -> None:
    app = canary_app()
    cfg = app.settings.model_dump(by_alias=True)
    cfg["model_rewrites"] = [configured("alias", exact("claude-x", ("claude-x-2026", None)))]
    cfg["prefix_routing"]["anthropic_cache_control_injection"] = True
    app.path.configure(parse_settings(cfg))
    body = {"model": "claude-x", "max_tokens": 8, "system": "terse", "messages": [{"role": "user", "content": "q"}]}
    ex = await app.path.route(Inbound("/v1/messages", {":method": "POST"}, json.dumps(body).encode()))
    assert isinstance(ex, Exchange) and ex.body_out is not None
    out = json.loads(ex.body_out)
    assert out["model"] == "claude-x-2026" and out["system"][-1]["cache_control"] == {"type": "ephemeral"}
    ex.end(completed=True)
    out_a = await app.path.route(Inbound(COMPLETIONS, {":method": "POST"}, b'{"model": "adapter", "prompt": "x"}'))
    assert isinstance(out_a, Exchange) and out_a.body_out is None  # the old rule is gone
    out_a.end(completed=True)


async def test_watched_rewrites_apply_beside_the_configs_and_generic_model_labels_are_capped() -> None:
    app = app_of({"pool": {"backends": BACKENDS}})
    rw = app.path.rewrites
    assert not rw.active
    rw.watched = {"catch-all": watched("catch-all", 1.0, rule((), ("default-model", None)))}
    assert rw.active and rw.stats()["generic"] == {
        "rewrite": "catch-all", "source": "watched", "targets": {"default-model": 1},
    }  # fmt: skip
    for i in range(MAX_MODEL_LABELS + 5):
        out = rw.apply(RequestFacts(api="chat", model=f"m{i}"), {"model": f"m{i}"}, f'{{"model": "m{i}"}}'.encode())
        assert out is not None and out[0].model == "default-model" and out[2] == b'{"model": "default-model"}'
    total = sample(app, "llm_d_epp_model_rewrite_decisions_total", {
        "model_rewrite_name": "catch-all", "model_name": "other", "target_model": "default-model",
    })  # fmt: skip
    assert total == 5
    assert app.recorder.llmd.models.seen == {f"m{i}" for i in range(MAX_MODEL_LABELS)}  # the request families' cap
    rw.watched = {}
    assert not rw.active


def test_model_rewrites_config_is_refused_with_the_path_of_the_bad_key() -> None:
    bad = [
        configured("a", exact("m", ("x", 90), ("y", None))),
        configured("a", {"targets": []}),
    ]
    with pytest.raises(ConfigError) as err:
        parse_settings({"model_rewrites": bad})
    paths = [p for p, _ in err.value.problems]
    assert paths == ["model_rewrites[0].rules[0].targets", "model_rewrites[1].rules[0].targets"]
    with pytest.raises(ConfigError) as err:
        parse_settings({"model_rewrites": [configured("a", exact("m", ("x", None)))] * 2})
    assert err.value.problems[0][0] == "model_rewrites" and "unique" in err.value.problems[0][1]
    prefix = {"matches": [{"model": {"type": "Prefix", "value": "m"}}], "targets": [{"modelRewrite": "x", "weight": 0}]}
    with pytest.raises(ConfigError) as err:
        parse_settings({"model_rewrites": [configured("a", prefix)]})
    assert [p for p, _ in err.value.problems] == [
        "model_rewrites[0].rules[0].matches[0].model.type", "model_rewrites[0].rules[0].targets[0].weight",
    ]  # fmt: skip


def test_no_rewrites_no_cost() -> None:
    rw = ModelRewrites(CollectorRegistry())
    assert not rw.active and rw.apply(RequestFacts(api="chat", model="m"), {"model": "m"}, b'{"model":"m"}') is None


async def test_answers_are_unaffected_by_a_bad_request() -> None:
    out = await canary_app().path.route(Inbound(CHAT, {":method": "POST"}, b'{"model": "adapter"}'))
    assert isinstance(out, Answer) and out.status == 400  # no messages: refused at parse, before any rewrite


def test_config_rules_that_never_apply_are_warned_and_a_dumped_config_parses_again() -> None:
    rewrites = [
        configured("a", exact("x", ("y", None))),
        configured("b", exact("x", ("z", None)), {"targets": [{"modelRewrite": "g"}]}),
        configured("c", {"targets": [{"modelRewrite": "h"}]}),
    ]
    s = parse_settings({"model_rewrites": rewrites})
    assert [w for w in config_warnings(s) if w[0].startswith("model_rewrites")] == [
        ("model_rewrites[1].rules[0].matches[0]", "never applies: model_rewrites[0].rules[0] matches 'x' first"),
        ("model_rewrites[2].rules[0]", "never applies: model_rewrites[1].rules[1] is an earlier generic rule (the "
         "first one wins)"),
    ]  # fmt: skip
    dumped = s.model_dump()
    assert dumped["model_rewrites"][0]["rules"][0]["targets"][0]["modelRewrite"] == "y"  # the CRD's spelling
    assert parse_settings(dumped).model_rewrites == s.model_rewrites
