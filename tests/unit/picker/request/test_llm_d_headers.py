"""llm-d's request headers (docs/llm-d-compat.md): the stateless ``x-session-token``, the agent identity headers
as session and fairness keys, ``X-Gateway-Model-Name``, ``Prefer: if-available`` and the endpoint scores in the
pick's metadata; through the request path and the ext_proc stream, without Envoy."""

from __future__ import annotations

import base64
import json

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from picker.facts import Answer, RequestFacts
from picker.flow.controller import FlowController, FlowListener
from picker.kv.stage import KvLookup
from picker.kv.tier4 import Tier4
from picker.request.exchange import Exchange
from picker.request.path import Inbound, covering, prefers_if_available
from picker.request.session_token import MAX_TOKEN_CHARS, SessionTokens
from picker.routing.core import Prepared
from picker.routing.endpoints import BackendHold, StorageTier
from picker.routing.served_models import EndpointModels, ServedModels
from picker.runtime.app import PickerApp
from tests.support.builders import BACKENDS, CHAT, app_of, stream_of

ADDR = {b["name"]: b["address"] for b in BACKENDS}


def make_app(**extra) -> PickerApp:
    return app_of({"selection_strategy": "RoundRobin", "pool": {"backends": BACKENDS}} | extra)


def chat_body(user: str = "q") -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": user}]}).encode()


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


async def route(app: PickerApp, headers: dict[str, str], body: bytes | None = None, subset=None) -> Exchange | Answer:
    return await app.path.route(Inbound(CHAT, {":method": "POST", **headers}, body or chat_body(), subset))


# -- the token ---------------------------------------------------------------------------------------------
def test_a_token_names_its_endpoint_and_nothing_else() -> None:
    kube, static = SessionTokens("llm"), SessionTokens()
    assert kube.mint("vllm-0") == b64("llm/vllm-0")  # llm-d's token of pod llm/vllm-0
    assert kube.endpoint(kube.mint("vllm-0")) == "vllm-0"
    assert kube.endpoint(b64("other/vllm-0")) is None  # a pod of another namespace
    assert kube.endpoint(b64("vllm-0")) == "vllm-0"  # a static pool's token
    assert static.mint("a") == b64("a") and static.endpoint(b64("any/a")) == "a"
    # re-encoded by a client: URL-safe alphabet, padding dropped
    weird = "ns/a?>"  # encodes with '+' or '/' and padding
    url_safe = base64.urlsafe_b64encode(weird.encode()).decode().rstrip("=")
    assert SessionTokens("ns").endpoint(url_safe) == "a?>"
    for bad in ("", "!!!", "////", b64("ns/"), "A" * (MAX_TOKEN_CHARS + 4), base64.b64encode(b"\xff\xfe").decode()):
        assert kube.endpoint(bad) is None, bad


def test_prefer_if_available_is_read_as_rfc_7240_says() -> None:
    for yes in ("if-available", "IF-AVAILABLE", "respond-async, if-available", "wait=5; x=1, if-available;y"):
        assert prefers_if_available(yes), yes
    for no in (None, "", "respond-async", "wait=10", "if-availablex", "x=if-available"):
        assert not prefers_if_available(no), no


async def test_a_token_sends_the_conversation_back_to_its_endpoint_without_a_table() -> None:
    app = make_app()
    picks = set()
    for i in range(6):  # RoundRobin: without a token the requests alternate
        ex = await route(app, {}, chat_body(f"q{i}"))
        assert isinstance(ex, Exchange)
        picks.add(ex.decision.endpoint.name)
        assert ex.session_token == b64(ex.decision.endpoint.name)  # minted for every routed request
        ex.end(completed=True)
    assert picks == {"a", "b"}
    for i in range(6):
        ex = await route(app, {"x-session-token": b64("b")}, chat_body(f"turn {i}"))
        assert isinstance(ex, Exchange) and ex.decision.endpoint.name == "b" and ex.decision.reason == "session"
        ex.end(completed=True)
    assert len(app.path.sessions) == 0  # no server-side state
    # another picker of the pool (a new process) honours it the same way
    other = make_app()
    ex = await route(other, {"x-session-token": b64("b")})
    assert isinstance(ex, Exchange) and ex.decision.endpoint.name == "b"
    ex.end(completed=True)


async def test_a_token_is_honoured_only_while_its_endpoint_is_eligible() -> None:
    app = make_app()
    ex = await route(app, {"x-session-token": b64("b")}, subset=[ADDR["a"]])  # b is outside the subset
    assert isinstance(ex, Exchange) and ex.decision.endpoint.name == "a"
    assert ex.session_token == b64("a")  # the conversation moves: its token follows
    ex.end(completed=True)
    for token in (b64("gone"), "not base64 !", b64("elsewhere/b")):
        app.path.set_namespace("ns")
        ex = await route(app, {"x-session-token": token})
        assert isinstance(ex, Exchange) and ex.decision.reason != "session", token
        ex.end(completed=True)


async def test_the_token_can_be_turned_off() -> None:
    app = make_app(session_affinity={"token": False})
    for _ in range(4):
        ex = await route(app, {"x-session-token": b64("b")})
        assert isinstance(ex, Exchange) and ex.decision.reason != "session" and ex.session_token is None
        ex.end(completed=True)


async def test_the_response_carries_the_token_of_the_endpoint_that_served() -> None:
    """Echoed on the response headers (every response mode sees them); after a retry, the endpoint that
    answered (Envoy's served-endpoint metadata) is the one named."""
    stream = stream_of(make_app())
    req = pb.ProcessingRequest()
    h = req.request_headers.headers.headers
    for k, v in ((":path", CHAT), (":method", "POST")):
        h.add(key=k, raw_value=v.encode())
    req.request_headers.end_of_stream = False
    assert list(await stream.handle(req)) == []
    body = pb.ProcessingRequest()
    body.request_body.body, body.request_body.end_of_stream = chat_body(), True
    await stream.handle(body)
    ex = stream.exchange
    assert isinstance(ex, Exchange)
    picked, other = ex.decision.endpoint.name, ({"a", "b"} - {ex.decision.endpoint.name}).pop()
    resp = pb.ProcessingRequest()
    resp.response_headers.headers.headers.add(key=":status", raw_value=b"200")
    lb = resp.metadata_context.filter_metadata["envoy.lb"]
    lb.fields["x-gateway-destination-endpoint-served"].string_value = ADDR[other]  # retried on the other one
    (answer,) = await stream.handle(resp)
    sets = {
        o.header.key: o.header.raw_value.decode() for o in answer.response_headers.response.header_mutation.set_headers
    }
    assert sets["x-session-token"] == b64(other) != b64(picked)
    stream.close()


# -- agent identity ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("header", ["x-claude-code-session-id", "x-session-affinity", "session-id", "session_id"])
async def test_an_agent_identity_header_names_the_session(header: str) -> None:
    app = make_app(session_affinity={"enabled": True})
    first = await route(app, {header: "agent-7"}, chat_body("one"))
    assert isinstance(first, Exchange) and first.facts.session_id == "agent-7"
    first.end(completed=True)
    for i in range(4):  # RoundRobin would alternate: the session table keeps it
        ex = await route(app, {header: "agent-7"}, chat_body(f"turn {i}"))
        assert isinstance(ex, Exchange) and ex.decision.endpoint.name == first.decision.endpoint.name
        ex.end(completed=True)


def test_the_configured_session_header_comes_before_the_agent_identity_ones() -> None:
    app = make_app()
    both = {":method": "POST", "x-session-id": "configured", "session-id": "agent"}
    assert app.path.parse(Inbound(CHAT, both, chat_body())).session_id == "configured"
    assert app.path.parse(Inbound(CHAT, {":method": "POST", "session_id": "s"}, chat_body())).session_id == "s"
    none = make_app(session_affinity={"identity_headers": []})
    assert none.path.parse(Inbound(CHAT, {":method": "POST", "session-id": "x"}, chat_body())).session_id is None


class Left(FlowListener):
    def __init__(self) -> None:
        self.fids: list[str] = []

    def left(self, priority: int, fairness_id: str, nbytes: int, outcome: str, waited_s: float, queued: bool) -> None:
        self.fids.append(fairness_id)


async def test_an_agent_identity_is_the_fairness_id_when_flow_controls_own_header_is_absent() -> None:
    app = make_app(
        pool={"backends": BACKENDS, "engine_metrics": {"enabled": False}},  # saturation from the picker's own counts
        flow_control={"enabled": True, "default_ttl_ms": 2000},
    )  # fmt: skip
    flow: FlowController = app.path.flow
    left = Left()
    flow.listener = left
    for headers in (
        {"x-llm-d-inference-fairness-id": "tenant-1", "session-id": "agent"},  # flow control's own header first
        {"x-claude-code-session-id": "claude-1"},
        {},
    ):
        ex = await route(app, headers)
        assert isinstance(ex, Exchange)
        ex.end(completed=True)
    assert left.fids == ["tenant-1", "claude-1", "default-flow"]


# -- the model header --------------------------------------------------------------------------------------
def test_x_gateway_model_name_names_the_model_of_a_request_routed_without_its_body() -> None:
    path = make_app().path
    headers = {":method": "POST", "x-gateway-model-name": "llama-lora"}
    assert path.parse(Inbound(CHAT, headers, None)).model == "llama-lora"  # routed at the headers
    assert path.parse(Inbound(CHAT, headers, chat_body())).model == "m"  # the body is the truth when it is read
    assert path.parse(Inbound(CHAT, {":method": "POST"}, None)).model is None


# -- Prefer: if-available ----------------------------------------------------------------------------------
class Holds:
    def __init__(self, holds: dict[str, int], keys: int) -> None:
        self.holds = {n: BackendHold(b, StorageTier.GPU_HOT) for n, b in holds.items()}
        self.keys = list(range(1, keys + 1))

    async def lookup(self, facts: RequestFacts) -> KvLookup:
        return KvLookup(dict(self.holds), len(self.keys) * 16, block_keys=self.keys)

    def page_tokens(self, backend: str) -> int | None:
        return None


def with_holds(app: PickerApp, holds: dict[str, int], keys: int) -> PickerApp:
    app.path.holds = Holds(holds, keys)
    app.path.configure(app.settings)
    return app


def loaded_app() -> tuple[PickerApp, list]:
    """a holds all 4 blocks of the prompt, b 3; long prefills are queued on a (the cost model would pick b)."""
    app = with_holds(make_app(kv_cache_index={"enabled": True}, prefix_routing={"enabled": True}), {"a": 4, "b": 3}, 4)
    a = app.pool.endpoint("a")
    assert a is not None
    return app, [app.pool.acquire(a, 20_000) for _ in range(4)]


async def test_if_available_routes_only_to_an_endpoint_that_holds_the_whole_prompt() -> None:
    app, _ = loaded_app()
    plain = await route(app, {})
    assert isinstance(plain, Exchange) and plain.decision.endpoint.name == "b"
    app, _ = loaded_app()  # a fresh picker (the first one placed the prompt on b: Tier 4 counts b as holding it)
    ex = await route(app, {"prefer": "if-available"})
    assert isinstance(ex, Exchange) and ex.decision.endpoint.name == "a"  # the only one holding all 4 blocks
    assert ex.decision.fallbacks == ()  # a retry must not land on an endpoint without the prompt


async def test_if_available_is_a_412_with_a_json_body_when_no_eligible_endpoint_holds_it() -> None:
    app = with_holds(make_app(kv_cache_index={"enabled": True}, prefix_routing={"enabled": True}), {"a": 4, "b": 3}, 4)
    out = await route(app, {"prefer": "if-available"}, subset=[ADDR["b"]])  # a holds it but is outside the subset
    assert isinstance(out, Answer) and out.status == 412
    err = json.loads(out.body)["error"]
    assert err["code"] == "not_cached" and err["type"] == "precondition_failed" and "if-available" in err["message"]
    assert app.metrics.registry.get_sample_value("continuum_picker_requests_total", {"outcome": "not_cached"}) == 1
    assert all(s.in_flight == 0 for s in app.pool.view().states)  # nothing committed
    # Tier 4 off: the picker cannot promise a cached endpoint
    off = await route(make_app(), {"prefer": "if-available"})
    assert isinstance(off, Answer) and off.status == 412 and b"Tier 4 is off" in off.body


def names(view) -> list[str]:
    return [s.endpoint.name for s in view.states]


def test_covering_needs_every_keyed_block_of_the_engines_full_pages() -> None:
    view = make_app().pool.view()
    held = {"a": BackendHold(3, StorageTier.GPU_HOT), "b": BackendHold(2, StorageTier.STORAGE_WARM)}
    assert names(covering(view, Prepared(holds=held, block_keys=(1, 2, 3)), 16)) == ["a"]
    assert names(covering(view, Prepared(holds=held, block_keys=(1, 2)), 16)) == ["a", "b"]
    # pages of 32 tokens (2 key blocks): 3 keyed blocks are 1 full page, which b holds; the third block is in a
    # partial page the engine never stores
    pages = {"a": 32, "b": 32}
    assert names(covering(view, Prepared(holds=held, block_keys=(1, 2, 3)), 16, pages.get)) == ["a", "b"]
    assert names(covering(view, Prepared(holds=held, block_keys=(1, 2, 3, 4, 5)), 16, pages.get)) == []
    assert names(covering(view, Prepared(holds=held, block_keys=(1,)), 16, pages.get)) == []  # under a page
    assert covering(view, Prepared(holds=held, block_keys=()), 16).states == ()  # nothing keyed: nothing promised
    assert covering(view, Prepared(holds=None, block_keys=(1,)), 16).states == ()


# -- endpoint scores ---------------------------------------------------------------------------------------
async def pick_metadata(app: PickerApp) -> dict:
    stream = stream_of(app)
    req = pb.ProcessingRequest()
    for k, v in ((":path", CHAT), (":method", "POST")):
        req.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    await stream.handle(req)
    body = pb.ProcessingRequest()
    body.request_body.body, body.request_body.end_of_stream = chat_body(), True
    first = (await stream.handle(body))[0]
    lb = first.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    out = {k: v for k, v in lb.items()}
    stream.close()
    return out


async def test_endpoint_scores_ride_in_the_pick_metadata_only_when_asked() -> None:
    key = "x-gateway-destination-endpoint-scores"
    assert key not in await pick_metadata(with_holds(make_app(kv_cache_index={"enabled": True}), {"a": 4}, 4))
    on = make_app(
        kv_cache_index={"enabled": True}, prefix_routing={"enabled": True}, extproc={"emit_endpoint_scores": True}
    )
    app = with_holds(on, {"a": 4, "b": 1}, 4)
    md = await pick_metadata(app)
    scores = {k: v.number_value for k, v in md[key].struct_value.fields.items()}
    assert set(scores) == {ADDR["a"], ADDR["b"]} and scores[ADDR["a"]] == 1.0 > scores[ADDR["b"]] > 0.0
    assert md["x-gateway-destination-endpoint"].string_value.split(",")[0] == ADDR["a"]
    # a strategy's pick scores nothing: the pick alone, at 1
    md = await pick_metadata(make_app(extproc={"emit_endpoint_scores": True}))
    scores = {k: v.number_value for k, v in md[key].struct_value.fields.items()}
    assert list(scores.values()) == [1.0] and md["x-gateway-destination-endpoint"].string_value.startswith(*scores)


# -- the base-model header ---------------------------------------------------------------------------------
def test_x_gateway_base_model_name_keys_an_adapter_no_engine_or_map_names() -> None:
    app = make_app(kv_cache_index={"enabled": True, "lora_adapters": {"mapped": "base-x"}})
    tier4 = app.path.holds
    assert isinstance(tier4, Tier4)
    facts = app.path.parse(Inbound(CHAT, {":method": "POST", "x-gateway-base-model-name": "base-a"}, chat_body()))
    assert facts.base_model == "base-a"
    assert tier4.resolve_model("adapter-1", None, "base-a") == ("base-a", "adapter-1")  # keyed as base + adapter
    assert tier4.resolve_model("adapter-1", None, None) == ("adapter-1", None)
    assert tier4.resolve_model("base-a", None, "base-a") == ("base-a", None)  # the base model itself
    assert tier4.resolve_model("mapped", None, "base-a") == ("base-x", "mapped")  # the static map wins
    # an engine that lists the model as a base model wins over the hint
    app.pool.set_served_models(ServedModels({"a": EndpointModels(frozenset({"adapter-1"}), {})}))
    assert tier4.resolve_model("adapter-1", None, "base-a") == ("adapter-1", None)
    app.pool.set_served_models(ServedModels({"a": EndpointModels(frozenset({"base-b"}), {"adapter-1": "base-b"})}))
    assert tier4.resolve_model("adapter-1", None, "base-a") == ("base-b", "adapter-1")


async def test_a_token_of_an_endpoint_gone_from_the_pool_gives_way_to_the_session_table() -> None:
    app = make_app(session_affinity={"enabled": True})
    first = await route(app, {"x-session-id": "s-1"}, chat_body("one"))
    assert isinstance(first, Exchange)
    first.end(completed=True)
    home = first.decision.endpoint.name
    for i in range(3):  # RoundRobin alone would alternate: the table keeps the session home
        ex = await route(app, {"x-session-id": "s-1", "x-session-token": b64("gone-pod")}, chat_body(f"t{i}"))
        assert isinstance(ex, Exchange) and ex.decision.endpoint.name == home and ex.decision.reason == "session"
        ex.end(completed=True)
