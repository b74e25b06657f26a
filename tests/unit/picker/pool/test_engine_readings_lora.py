"""vLLM's ``lora_requests_info``: a gauge whose labels are the LoRA slots' state and whose value is the time it was
set; every label set ever seen stays in the body, so the reading is the sample with the largest value. The bodies
below have the shape real vLLM 0.32 (CPU) wrote with ``--enable-lora --max-loras 2`` (docs/real-engines.md)."""

from __future__ import annotations

from picker.pool.engine_readings import MAX_LORA_ADAPTERS, lora_load, read_signals
from picker.pool.exposition import largest_sample
from picker.routing.served_models import LoraLoad

HEAD = "# HELP vllm:lora_requests_info Running stats on lora requests.\n# TYPE vllm:lora_requests_info gauge\n"
QUEUE = (
    'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
    'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
)


def info(max_lora: str, running: str, waiting: str, at: float) -> str:
    return (
        f'vllm:lora_requests_info{{max_lora="{max_lora}",running_lora_adapters="{running}",'
        f'waiting_lora_adapters="{waiting}"}} {at!r}\n'
    )


def test_the_latest_sample_is_the_state_whatever_its_place_in_the_body() -> None:
    body = HEAD + info("2", "", "", 1.7961952714649932e09) + info("2", "tiny-lora", "tiny-lora", 1.7961952714352157e09)
    assert lora_load(body) == LoraLoad(2)  # the request ended after the adapter's sample: nothing in flight now
    body = HEAD + info("2", "", "", 1.79e09) + info("2", "a,b", "b", 1.80e09) + info("2", "c", "", 1.70e09)
    assert lora_load(body) == LoraLoad(2, frozenset({"a", "b"}), frozenset({"b"}))


def test_the_reading_reaches_the_engine_signals() -> None:
    signals, _ = read_signals(QUEUE + HEAD + info("4", "sql,chat", "sql,chat", 1.8e09))
    assert signals is not None and signals.running == 1
    assert signals.lora == LoraLoad(4, frozenset({"sql", "chat"}), frozenset({"sql", "chat"}))
    signals, _ = read_signals(QUEUE)  # an engine without LoRA
    assert signals is not None and signals.lora is None


def test_a_bad_reading_is_none_and_never_raises() -> None:
    assert lora_load(QUEUE) is None
    assert lora_load(HEAD + info("two", "a", "", 1.8e09)) is None
    assert lora_load(HEAD + info("²", "a", "", 1.8e09)) is None  # a digit to str.isdigit, not to int()
    assert lora_load(HEAD + info("-1", "a", "", 1.8e09)) is None
    assert lora_load(HEAD + info("1000001", "a", "", 1.8e09)) is None
    assert lora_load(HEAD + 'vllm:lora_requests_info{running_lora_adapters="a"} 1.8e09\n') is None  # no max_lora
    # NaN / Inf values and a broken line are passed over: the valid sample is the reading
    body = HEAD + info("2", "x", "", float("nan")) + info("2", "y", "", float("inf")) + "vllm:lora_requests_info{\n"
    assert lora_load(body + info("2", "z", "", 5.0)) == LoraLoad(2, frozenset({"z"}))


def test_adapter_lists_are_bounded() -> None:
    names = ",".join(f"a{i}" for i in range(MAX_LORA_ADAPTERS * 4)) + ",,"
    load = lora_load(HEAD + info("8", names, "", 1.8e09))
    assert load is not None and len(load.running) == MAX_LORA_ADAPTERS and "a0" in load.running


def test_largest_sample_keeps_one_and_reads_only_its_family() -> None:
    body = "vllm:lora_requests_info_other 9e99\n# vllm:lora_requests_info 9e99\n" + HEAD + info("1", "a", "", 3.0)
    s = largest_sample(body, "vllm:lora_requests_info")
    assert s is not None and s.value == 3.0 and s.label("running_lora_adapters") == "a"
    assert largest_sample("", "vllm:lora_requests_info") is None
