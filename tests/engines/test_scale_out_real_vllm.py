"""The shared load view (docs/scale-out.md) in front of real vLLM: two pickers, each behind its own Envoy (so the
test says which picker routes which request), one kv-listener on the engines' events feeding both (Tier 4), one
real Valkey carrying the view. What the engines themselves report is the truth the pickers' views are held to:

- while requests routed by both pickers generate, each picker counts the other's as its peer's, and every
  picker's count of an engine's requests (its own plus its peer's) equals the engine's own
  ``vllm:num_requests_running`` + ``vllm:num_requests_waiting``; when they finish, the peer counts go back to 0;
- a long prompt sent through one picker and then through the other is served from the engine that holds it
  (vLLM's ``cached_tokens`` covers its full pages);
- Valkey killed (SIGKILL): both pickers keep routing and stay ready, ``/readyz`` says ``lost``; Valkey back on
  its port: the view is ``up`` again with the peer in it.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from benchmarks.loadgen import parse_prometheus_text
from benchmarks.stack import (
    EnvoyProcess,
    ListenerProcess,
    PickerProcess,
    make_workdir,
    start_listener,
    start_picker,
)
from benchmarks.vllm_engine.process import MODEL_NAME, VllmProcess
from tests.engines.conftest import listener_config, picker_config, pinning_envoy
from tests.engines.real_stack import PIN_HEADER, Usage, stream_chat
from tests.engines.test_real_vllm import text
from tests.integration.conftest import http
from tests.support.poll import wait_until
from tests.support.valkey import ValkeyProcess

pytestmark = [pytest.mark.envoy, pytest.mark.valkey]
P32, P64 = "vllm-p32", "vllm-p64"
LONG_TOKENS = 1536  # generated per long request (ignore_eos): ~15 s of decoding here, the views compared within
HANG_UP_TOKENS = 4096  # asked for by the requests whose clients hang up (they never get that far)
ATTEMPTS = 3  # of the comparison: the machine can stall for seconds, and one engine's requests end before all ran
KEY = "kv-epp-test:{load}"


@dataclass
class ScaleOut:
    engines: list[VllmProcess]
    valkey: ValkeyProcess
    listener: ListenerProcess
    pickers: dict[str, PickerProcess] = field(default_factory=dict)  # "a", "b"
    envoys: dict[str, EnvoyProcess] = field(default_factory=dict)  # each picker's own Envoy
    last: dict[str, Any] = field(default_factory=dict)  # the last counts() seen

    def engine(self, name: str) -> VllmProcess:
        return next(e for e in self.engines if e.config.name == name)

    def pool(self, p: str) -> dict[str, dict[str, Any]]:
        """Picker ``p``'s ``/admin/pool`` backends by name."""
        body = http("GET", self.pickers[p].admin_url + "/admin/pool", timeout=30).json()
        return {b["backend"]: b for b in body["backends"]}

    def readyz(self, p: str) -> tuple[int, dict[str, Any]]:
        r = http("GET", self.pickers[p].admin_url + "/readyz", timeout=30)
        return r.status, r.json()

    def view(self, p: str) -> dict[str, Any]:
        return dict(http("GET", self.pickers[p].admin_url + "/admin/pool", timeout=30).json()["shared_load"])

    def engine_requests(self, name: str) -> tuple[int, int]:
        """The engine's own counts: ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``."""
        body = http("GET", self.engine(name).base_url + "/metrics", timeout=30).body.decode()
        got = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}
        for n, _, v in parse_prometheus_text(body):
            if n in got:
                got[n] += v
        return int(got["vllm:num_requests_running"]), int(got["vllm:num_requests_waiting"])

    def counts(self) -> dict[str, Any]:
        """One look at every count: per engine its own (running + waiting, and running alone under ``running``), and
        per picker and engine the picker's
        ``(own in flight, peer in flight, own decoding, peer decoding, peer pending prefill tokens)``; kept in
        ``last`` for a failure's message."""
        pools = {p: self.pool(p) for p in self.pickers}
        keys = ("in_flight_requests", "peer_in_flight_requests", "decoding_requests", "peer_decoding_requests",
                "peer_pending_prefill_tokens")  # fmt: skip
        snap: dict[str, Any] = {p: {n: tuple(b[k] for k in keys) for n, b in pool.items()} for p, pool in pools.items()}
        engine = {n: self.engine_requests(n) for n in (P32, P64)}
        snap["engine"] = {n: running + waiting for n, (running, waiting) in engine.items()}
        snap["running"] = {n: running for n, (running, _) in engine.items()}
        self.last = snap
        return snap

    def wait(self, predicate: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
        """``wait_until`` polling every 0.1 s; its failure names the last counts seen."""
        try:
            return wait_until(predicate, timeout=timeout, interval=0.1, what=what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the last counts (own, peer, own decoding, peer decoding, peer pending "
                                 f"tokens): {self.last}") from None  # fmt: skip

    def idle(self) -> bool:
        """Every count 0: the engines', and every picker's own and peer counts."""
        snap = self.counts()
        return all(v == 0 for v in snap["engine"].values()) and all(
            not any(c) for p in self.pickers for c in snap[p].values()
        )

    def finished(self, name: str) -> dict[str, float]:
        """The engine's ``vllm:request_success_total`` by ``finished_reason``, and its ``vllm:generation_tokens_total``
        (under ``"generated"``)."""
        body = http("GET", self.engine(name).base_url + "/metrics", timeout=30).body.decode()
        out: dict[str, float] = {"generated": 0.0}
        for n, labels, v in parse_prometheus_text(body):
            if n == "vllm:request_success_total":
                reason = labels.get("finished_reason", "")
                out[reason] = out.get(reason, 0.0) + v
            elif n == "vllm:generation_tokens_total":
                out["generated"] += v
        return out

    def chat(self, p: str, messages: list[dict[str, str]], max_tokens: int = 4) -> tuple[Usage, str]:
        """A streamed chat through picker ``p``'s Envoy: its usage and the engine that served it."""
        headers: dict[str, str] = {}
        usage = stream_chat(self.envoys[p].url, messages, max_tokens, response_headers=headers)
        return usage, served(headers)

    def both_up_with_each_other(self) -> bool:
        views = {p: self.view(p) for p in self.pickers}
        ids = {p: v["picker_id"] for p, v in views.items()}
        return all(v["state"] == "up" and set(v["peers"]) == {ids[q] for q in ids if q != p} for p, v in views.items())


def served(headers: dict[str, str]) -> str:
    """The endpoint that served an answer: its ``x-session-token`` (llm-d's affinity token, on by default; a static
    pool's token is the base64 of the endpoint's name)."""
    return base64.b64decode(headers["x-session-token"]).decode()


class LongStream(threading.Thread):
    """One long streamed chat (``ignore_eos``: exactly ``max_tokens`` generated) through an Envoy, pinned to an
    engine by the subset hint; ``first`` is set at its first content chunk, ``done`` at its end. ``hang_up`` set:
    the client closes its connection at its next chunk."""

    def __init__(self, url: str, engine: VllmProcess, tag: str, max_tokens: int = LONG_TOKENS) -> None:
        super().__init__(daemon=True, name=f"long-{tag}")
        self.url, self.engine, self.tag, self.max_tokens = url, engine, tag, max_tokens
        self.first, self.done, self.hang_up = threading.Event(), threading.Event(), threading.Event()
        self.ended_at = 0.0  # monotonic
        self.served: str | None = None
        self.completion_tokens: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": f"{self.tag}: {text(self.tag, 2)}"}],
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {"content-type": "application/json", PIN_HEADER: self.engine.address}
        req = urllib.request.Request(self.url + "/v1/chat/completions", json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                assert r.status == 200
                self.served = served({k.lower(): v for k, v in r.headers.items()})
                for raw in r:
                    if self.hang_up.is_set():
                        break  # the connection is closed as the with block ends
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if chunk.get("usage"):
                        self.completion_tokens = int(chunk["usage"]["completion_tokens"])
                    if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                        self.first.set()
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self.first.set()
            self.done.set()


@pytest.fixture(scope="module")
def scale_out(engines: list[VllmProcess]) -> Iterator[ScaleOut]:
    """Valkey, the listener, pickers ``a`` and ``b`` (the shared view on, Tier 4 on the listener's feed) and an
    Envoy for each; every process stopped by its pid at the end."""
    workdir = make_workdir("kv-epp-scale-out-")
    valkey = ValkeyProcess(workdir / "valkey")
    procs: list[Any] = []
    try:
        valkey.start()
        listener = start_listener(listener_config(engines), workdir, name="listener")
        procs.append(listener)
        st = ScaleOut(engines, valkey, listener)
        for p in ("a", "b"):
            # one self-check is enough: it sends a probe to each engine, which the engine counts as a request
            cfg = picker_config(engines, listener.url, checks={"self_check": p == "a"})
            cfg["shared_load"] = {"enabled": True, "key": KEY, "picker_id": f"picker-{p}", "retry_seconds": 0.5}
            cfg["response_cache"] = {"redis": {"url": valkey.url}}
            picker = start_picker(cfg, workdir, name=f"picker-{p}")
            procs.append(picker)
            envoy = pinning_envoy(picker, engines, workdir)
            procs.append(envoy)
            st.pickers[p], st.envoys[p] = picker, envoy
        wait_until(st.both_up_with_each_other, timeout=60.0, what="both pickers' views up, each the other's peer")
        # picker a's self-check probes each engine once: done before any count is compared
        wait_until(
            lambda: "pending" not in {v["self_check"] for v in st.readyz("a")[1]["kv_feeds"].values()},
            timeout=120.0,
            what="picker a's self-checks",
        )
        st.wait(st.idle, "both engines idle")
        yield st
    finally:
        for proc in reversed(procs):
            proc.stop()
        valkey.stop()


def test_each_picker_counts_the_others_requests_as_the_engines_do(scale_out: ScaleOut) -> None:
    """Long requests routed by both pickers generate on both engines: each picker's ``peer_in_flight_requests``
    is what the other sent there, own + peer equals the engine's running + waiting, and own + peer decoding equals
    the engine's running (Tier 4 counts a request decoding once the KV events confirm its prefill), at a moment
    when every request is running (each has streamed a chunk and none has ended). After they end, every count
    is 0.

    The machine can stall for seconds (2 cores; a picker's loop was seen 4.3 s late): one engine's requests may then
    end before the other's start, or the view be lost for a moment (it comes back). Such a round is run again, up
    to ``ATTEMPTS`` times; a round whose requests all ran and whose counts never agreed fails at once."""
    st = scale_out
    plan = {"a": {P32: 2, P64: 1}, "b": {P32: 1, P64: 2}}  # requests per picker and engine (pinned by subset)
    for attempt in range(1, ATTEMPTS + 1):
        outcome = compare_while_running(st, plan, attempt)
        st.wait(st.idle, "every count back to 0")
        if outcome:
            return
    pytest.fail(f"in {ATTEMPTS} rounds a request ended before the views and the engines agreed: {st.last}")


def compare_while_running(st: ScaleOut, plan: dict[str, dict[str, int]], attempt: int) -> bool:
    """One round: the planned long requests, the counts compared until they agree while all run. False: a request
    ended first (the round proves nothing)."""
    streams: dict[str, list[LongStream]] = {p: [] for p in plan}
    for p, per_engine in plan.items():
        for name, n in per_engine.items():
            for i in range(n):
                s = LongStream(st.envoys[p].url, st.engine(name), f"long{attempt}-{p}-{name}-{i}")
                streams[p].append(s)
                s.start()
    every = [s for ss in streams.values() for s in ss]
    polls, first, started = 0, {}, time.monotonic()
    try:
        for s in every:
            assert s.first.wait(300), f"{s.tag}: no first chunk"
            assert s.error is None, f"{s.tag}: {s.error!r}"
        sent = {p: {n: sum(s.served == n for s in streams[p]) for n in (P32, P64)} for p in plan}
        assert sent == plan, "each request was served by the engine it was pinned to"
        started = time.monotonic()

        def agree() -> tuple[str, dict[str, Any]] | None:
            nonlocal polls, first
            polls += 1
            snap = st.counts()
            # read after the counts: a request not ended now was running at the engine during every read above
            if any(s.done.is_set() for s in every):
                return ("ended", snap)
            first = first or snap  # the first poll's counts (printed when it did not agree)
            for n in (P32, P64):
                for p, other in (("a", "b"), ("b", "a")):
                    own, peer, decoding, peer_decoding, _ = snap[p][n]
                    if (own, peer) != (sent[p][n], sent[other][n]) or peer_decoding != snap[other][n][2]:
                        return None
                    # every request is decoding (it streamed content): so in the view, once the KV events
                    # confirmed its prefill (Tier 4's commit stage), and at the engine
                    if own + peer != snap["engine"][n] or decoding + peer_decoding != snap["running"][n]:
                        return None
                if snap["running"][n] != sent["a"][n] + sent["b"][n]:
                    return None
            return ("agreed", snap)

        outcome, got = st.wait(agree, "the pickers' views to match the engines'", timeout=120.0)
        agreed = time.monotonic()
        lags = {p: st.view(p)["lag_ms"] for p in plan}
    finally:
        for s in every:
            s.join(600)
    for s in every:
        assert s.error is None, f"{s.tag}: {s.error!r}"
        assert s.completion_tokens == LONG_TOKENS, (s.tag, s.completion_tokens)
    if outcome == "ended":
        print(f"\nround {attempt}: a request ended before the counts agreed, after {polls} poll(s): {got}")
        return False
    ends = sorted(s.ended_at - agreed for s in every)
    before = f"; the first poll saw {first}" if polls > 1 else ""
    print(f"\nround {attempt}: agreed after {polls} poll(s), {agreed - started:.2f} s after every first chunk; the "
          f"requests ended {ends[0]:.2f} to {ends[-1]:.2f} s later; the last lag (ms) {lags}; the counts (own, peer, "
          f"own decoding, peer decoding, peer pending tokens): {got}{before}")  # fmt: skip
    return True


def test_a_client_that_hangs_up_leaves_no_count_behind(scale_out: ScaleOut) -> None:
    """Clients close long streams after their first chunks: vLLM aborts the requests, and both pickers' own and peer
    counts go back to 0 with the engines' (a count left behind would make an engine look busy to every picker)."""
    st = scale_out
    streams = [LongStream(st.envoys["a"].url, st.engine(P32), f"hang-a-{i}", HANG_UP_TOKENS) for i in range(2)]
    streams.append(LongStream(st.envoys["b"].url, st.engine(P64), "hang-b-0", HANG_UP_TOKENS))
    before = {n: st.finished(n) for n in (P32, P64)}
    for s in streams:
        s.start()
    try:
        for s in streams:
            assert s.first.wait(300) and s.error is None, (s.tag, s.error)

        def counted() -> bool:
            snap = st.counts()
            return snap["engine"] == {P32: 2, P64: 1} and snap["b"][P32][1] == 2 and snap["a"][P64][1] == 1

        st.wait(counted, "the three requests counted by the engines and the peers")
        for s in streams:
            s.hang_up.set()
    finally:
        for s in streams:
            s.join(600)
    assert all(s.error is None and s.completion_tokens is None for s in streams), [(s.tag, s.error) for s in streams]

    st.wait(st.idle, "every count back to 0 after the hang-ups")
    after = {n: st.finished(n) for n in (P32, P64)}
    delta = {n: {r: after[n][r] - before[n].get(r, 0.0) for r in after[n] if after[n][r] != before[n].get(r, 0.0)}
             for n in after}  # fmt: skip
    print(f"\nafter the hang-ups, the engines' counters moved by: {delta}")
    # vLLM stopped them: far fewer tokens than the 3 x HANG_UP_TOKENS asked for, and none finished by its length.
    # (vLLM 0.32 counts a request aborted by its client in no vllm:request_success_total series, "abort" included.)
    assert sum(d.get("generated", 0.0) for d in delta.values()) < 3 * HANG_UP_TOKENS, delta
    assert not any(d.get("length") for d in delta.values()), delta


def test_a_prompt_routed_by_one_picker_is_served_from_its_engine_through_the_other(scale_out: ScaleOut) -> None:
    """A long prompt sent through picker a, then (after a's answer) through picker b: b sends it to the engine that
    served a's request, and the engine serves every full page of it from its cache."""
    st = scale_out
    messages = [{"role": "system", "content": text("scale-out-shared", 40)}, {"role": "user", "content": "index 7?"}]
    first, holder = st.chat("a", messages)
    page = st.engine(holder).config.block_size
    assert first.cached_tokens is not None and first.cached_tokens < page, ("a new prompt", first)
    second, where = st.chat("b", messages)
    print(f"\nprompt {first.prompt_tokens} tokens: a sent it to {holder} (cached {first.cached_tokens}), b to {where} "
          f"(cached {second.cached_tokens})")  # fmt: skip
    assert where == holder, "picker b sends the prompt where picker a placed it"
    assert second.prompt_tokens == first.prompt_tokens
    assert second.cached_tokens is not None and second.cached_tokens >= second.prompt_tokens - page, second
    assert second.cached_tokens % page == 0, "the engine serves whole pages from its cache"


def test_valkey_killed_costs_the_view_never_the_routing(scale_out: ScaleOut) -> None:
    """Valkey SIGKILLed while both pickers run: both keep routing to the real engines and stay ready, their
    ``/readyz`` says the view is ``lost`` (its peers aged out within a peer TTL); Valkey restarted on its port: ``up``
    again."""
    st = scale_out
    assert st.valkey.pid is not None
    st.valkey.kill()

    def lost() -> bool:
        states = []
        for p in st.pickers:
            status, body = st.readyz(p)
            assert status == 200, (p, body)  # the view is detail, never readiness
            states.append(body["shared_load"]["state"])
        return all(s == "lost" for s in states)

    wait_until(lost, timeout=60.0, interval=0.1, what="both pickers' views lost")
    print(f"\nValkey killed: {[st.readyz(p)[1]['shared_load']['reason'] for p in st.pickers]}")
    for p in st.pickers:
        for i in range(2):
            usage, where = st.chat(p, [{"role": "user", "content": f"valkey is down: {p} {i} {text(f'dn{p}{i}', 2)}"}])
            assert usage.chunks >= 1 and where in (P32, P64)
        status, body = st.readyz(p)
        assert status == 200 and body["shared_load"]["state"] == "lost", body["shared_load"]
        # the peers' last load ages out as with the view up (peer_ttl_ms after their last entry): the fallback
        wait_until(
            lambda p=p: st.readyz(p)[1]["shared_load"]["peer_count"] == 0, timeout=30.0, interval=0.1,
            what=f"{p}'s peers aged out",
        )  # fmt: skip
        assert all(b["peer_in_flight_requests"] == 0 for b in st.pool(p).values())
    st.valkey.restart()
    wait_until(st.both_up_with_each_other, timeout=60.0, interval=0.1, what="both views up again, each the other's")
    for p in st.pickers:
        usage, _ = st.chat(p, [{"role": "user", "content": f"valkey is back: {p}"}])
        assert usage.chunks >= 1
        status, body = st.readyz(p)
        assert status == 200 and body["shared_load"]["state"] == "up", body["shared_load"]
        assert body["shared_load"]["outages"] >= 1
