"""Flow control: the bounded waiting room between admission and the routing decision (priority bands, fairness
between flows, saturation-gated dispatch, TTLs and drop reasons). See docs/flow-control.md.
"""
