"""The request-CPU benchmark measures real work: Envoy's six messages route a request through each
servicer (no timing assertions: the figures come from `python -m benchmarks.request_cpu`)."""

from __future__ import annotations

from benchmarks.overhead import chat_bodies
from benchmarks.request_cpu import cpu_us_per_request, envoy_messages, servicers


def test_every_driven_request_is_routed_by_the_picker() -> None:
    s = servicers()
    requests = [envoy_messages(b) for b in chat_bodies(4096, n=4)]
    cpu_us_per_request(s["picker"], requests, 20)
    recorder = s["picker"].path.recorder
    assert {k: n for k, n in recorder.outcomes.items() if n} == {"routed": 40}  # warm-up and measured, none refused
    assert sum(recorder.responses.values()) == 40  # every response phase reached the observers
    assert s["picker"].path.pool.in_flight() == {"b0": 0, "b1": 0}  # every exchange ended
