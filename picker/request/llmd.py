"""The request path's side of llm-d's metric names (``picker.ops.llmd``): ``LlmdObserver.book`` counts each
request once it is routed or answered, with its labels (the model as parsed, the model served, the fairness id and
the priority as flow control reads them), and the observer follows a routed request's response. The usage (tokens)
comes from the response sampling (``picker.extproc.sampling``), which reads the body's last bytes where the body
reaches the picker. See docs/llm-d-compat.md, "Metrics".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from picker.facts import Answer, RequestFacts, declared_length
from picker.flow.controller import OBJECTIVE_HEADER, FlowController
from picker.ops.llmd import LlmdMetrics
from picker.request.exchange import Exchange
from picker.request.external import ExternalExchange
from picker.request.model_rewrite import RewriteTable

NO_BACKEND = "kv_epp_no_backend"  # the details of the path's 503 when no endpoint is eligible


class Inbound(Protocol):
    """What ``book`` reads of a request as the protocol layer received it (``picker.request.path.Inbound``)."""

    headers: Mapping[str, str]
    body: bytes | None
    responses_readable: bool
    arrived: float | None


class LlmdObserver:
    """Books each request in llm-d's families (``book``) and follows a routed request's response: the status (a
    model-server error), the body's chunks (size, first chunk: time to first token) where Envoy sends them to the
    picker (response mode full), the end (duration, running). It observes only the exchanges it booked."""

    wants_body = False  # a body observer of the exchanges whose body reaches the picker, and only theirs

    def __init__(self, m: LlmdMetrics, flow: FlowController) -> None:
        self.m = m
        self.flow = flow

    def book(self, req: Inbound, facts: RequestFacts | None, result: Exchange | Answer) -> None:
        """Count one request the path routed (``result`` an ``Exchange``: its record goes on it, and this observer
        follows its response) or answered itself. ``facts`` None: the body did not parse (a 400)."""
        m = self.m
        if not m.on:
            return
        h = req.headers
        fairness = self.flow.fairness_label(h)
        priority = str(self.flow.priority_of(h.get(OBJECTIVE_HEADER)))
        model = facts.model if facts is not None else None
        nbytes = len(req.body) if req.body is not None else declared_length(h)
        if isinstance(result, Answer):
            unscheduled = result.details == NO_BACKEND  # the decide stage found no eligible endpoint
            m.answered(model, fairness, priority, result.status, nbytes, req.arrived, unscheduled)
            return
        if isinstance(result, ExternalExchange):
            m.external(model, fairness, priority, nbytes)
            return
        ep = result.lease.endpoint
        result.llmd = m.routed(
            model, result.facts.model, fairness, priority, nbytes, req.arrived, result.facts.stream, ep.name,
            ep.address, result.lease.prefill_tokens,
        )  # fmt: skip
        result.add_observer(self, body=req.responses_readable)

    def rewrites_changed(self, table: RewriteTable) -> None:
        """The model rewrites' rules changed: their matched models and targets are pinned in the model labels (as
        llm-d pins its InferenceModelRewrite names), so a flood of unconfigured names cannot fold them to ``other``."""
        choices = [*table.exact.values(), *((table.generic,) if table.generic is not None else ())]
        self.m.pin_models({*table.exact, *(model for c in choices for model in c.models)})

    def on_headers(self, ex: Exchange, status: int | None) -> None:
        if ex.llmd is not None:
            self.m.response_headers(ex.llmd, status)

    def on_body(self, ex: Exchange, chunk: bytes, end: bool) -> None:
        if ex.llmd is not None:
            self.m.response_chunk(ex.llmd, len(chunk))

    def on_end(self, ex: Exchange, completed: bool) -> None:
        if ex.llmd is not None:
            self.m.ended(ex.llmd, completed)
