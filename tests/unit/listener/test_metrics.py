"""listener.metrics: a departed source's series go (in one pass, however many sources), discovery event names are
checked and their number capped, and every per-source metric is one ``forget_sources`` knows."""

from __future__ import annotations

from listener.metrics import MAX_DISCOVERY_EVENTS, ListenerMetrics


def test_forgetting_many_sources_removes_only_their_series() -> None:
    """One pass over each metric's series, whatever the number of sources (a deleted pool drops them all)."""
    m = ListenerMetrics()
    for n in ("a", "b", "c"):
        m.messages_received.labels(n).inc()
        m.events_dropped.labels(n, "gap").inc()
        m.feed_records.labels(n).inc()
    assert m.forget_sources({"a", "b"}) == 6
    left = {s.labels.get("source") or s.labels.get("backend") for f in m.registry.collect() for s in f.samples}
    assert "c" in left and not {"a", "b"} & left
    m.background_task_failures.labels("source-c").inc(0)  # a discovered source's task (created at its start)
    m.background_task_failures.labels("gauges").inc(0)
    assert m.forget_source("c") == 4 and m.forget_sources(set()) == 0
    tasks = {s.labels["task"] for f in m.registry.collect() for s in f.samples if "task" in s.labels}
    assert tasks == {"gauges"}


def test_discovery_event_names_are_checked_and_capped() -> None:
    m = ListenerMetrics()

    def count(event: str) -> float | None:
        return m.registry.get_sample_value("continuum_listener_discovery_events_total", {"event": event})

    m.discovery_event("source_added")
    m.discovery_event("source_added", 2)
    m.discovery_event("Bad Name")
    m.discovery_event("x" * 41)
    assert count("source_added") == 3 and count("other") == 2 and count("Bad Name") is None
    for i in range(2 * MAX_DISCOVERY_EVENTS):
        m.discovery_event(f"event_{i}")
    names = {s.labels["event"] for f in m.registry.collect() for s in f.samples if "event" in s.labels}
    assert len(names) <= MAX_DISCOVERY_EVENTS + 1 and "other" in names  # beyond the cap: "other"


def test_every_series_labelled_by_a_source_is_forgotten() -> None:
    """A metric added with a source label but not listed for forget_sources would keep a departed pod's series."""
    m = ListenerMetrics()
    metrics = [v for v in vars(m).values() if hasattr(v, "_labelnames")]
    for metric in metrics:
        labels = list(metric._labelnames)
        if labels and labels[0] in ("source", "backend"):
            metric.labels(*(["gone"] + ["x"] * (len(labels) - 1)))
    assert m.forget_sources({"gone"}) > 0
    left = [s for f in m.registry.collect() for s in f.samples if "gone" in s.labels.values()]
    assert left == []
