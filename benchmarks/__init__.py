"""kv-epp benchmarks: engine simulator, workload generators, load generator and harnesses.

- ``benchmarks.engine_sim``: a vLLM-like replica (OpenAI HTTP API, /metrics, KV events over ZMQ).
- ``benchmarks.trace``: the JSONL trace format shared by every generator and harness.
- ``benchmarks.workloads``: trace generators (prefix repetition, shared-prefix groups, multi-turn chat
  with Zipf-skewed system prompts) and arrival processes (Poisson, rate ramp).
- ``benchmarks.bound``: the hit-rate bound of a trace (one replica, unlimited cache).
- ``benchmarks.loadgen``: replays a trace against a base URL and scrapes engine prefix-cache counters.
"""
