"""normalize and SemanticIndex as the vectors module states them: unit vectors from any usable input, the
float32 storage still matching a vector with itself at threshold 1, partitions kept apart, settings validated,
and expiry on add (a hand-driven clock)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from picker.cache.vectors import MAX_DIM, SemanticIndex, normalize


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def index(clock: Clock | None = None, **kw: float) -> SemanticIndex:
    opts: dict[str, float] = {"max_entries": 100, "ttl_seconds": 60, "threshold": 0.9}
    opts.update(kw)
    return SemanticIndex(clock=clock or Clock(), **opts)  # type: ignore[arg-type]


coords = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)
usable = st.lists(coords, min_size=1, max_size=64).filter(lambda v: math.hypot(*v) > 1e-6)


@given(v=usable, scale=st.floats(1e-3, 1e3))
def test_normalize_gives_a_unit_vector_that_ignores_scale(v: list[float], scale: float) -> None:
    unit = normalize(v)
    assert unit is not None and len(unit) == len(v)
    assert math.fsum(x * x for x in unit) == pytest.approx(1.0, abs=1e-12)
    scaled = normalize([x * scale for x in v])
    assert scaled is not None and all(a == pytest.approx(b, abs=1e-9) for a, b in zip(unit, scaled, strict=True))


def test_normalize_accepts_ints_tuples_and_max_dim_and_refuses_an_overflowing_length() -> None:
    assert normalize([3, 4]) == (0.6, 0.8)
    assert normalize((0.0, 2.0)) == (0.0, 1.0)
    full = normalize([1.0] * MAX_DIM)
    assert full is not None and len(full) == MAX_DIM
    assert normalize([1e308] * 4) is None  # finite coordinates, but the length is not finite


@given(v=usable)
def test_a_vector_matches_itself_at_threshold_one_despite_float32_storage(v: list[float]) -> None:
    idx = index(threshold=1.0)
    assert idx.add("p", v, "k")
    match = idx.lookup("p", v)
    assert match is not None and match.key == "k" and match.similarity == pytest.approx(1.0, abs=1e-9)


def test_partitions_never_match_each_other() -> None:
    idx = index()
    idx.add("a", [1.0, 0.0], "ka")
    assert idx.lookup("b", [1.0, 0.0]) is None
    assert idx.lookup("a", [1.0, 0.0]) is not None
    snap = idx.snapshot()
    assert (snap.entries, snap.partitions, snap.lookups, snap.hits, snap.added) == (1, 1, 2, 1, 1)


def test_re_adding_a_key_under_another_partition_moves_it() -> None:
    idx = index()
    idx.add("a", [1.0, 0.0], "k")
    idx.add("b", [1.0, 0.0], "k")
    assert idx.lookup("a", [1.0, 0.0]) is None
    hit = idx.lookup("b", [1.0, 0.0])
    assert hit is not None and hit.key == "k"
    assert len(idx) == 1 and idx.snapshot().partitions == 1 and idx.nbytes == 2 * 4


def test_an_add_drops_the_expired_oldest_entries() -> None:
    clock = Clock()
    idx = index(clock, ttl_seconds=10)
    idx.add("p", [1.0, 0.0], "old")
    clock.now += 10  # expires_at <= now: expired
    idx.add("q", [0.0, 1.0], "new")
    assert len(idx) == 1 and idx.nbytes == 2 * 4
    assert idx.snapshot().expired == 1 and idx.snapshot().evicted == 0


@pytest.mark.parametrize(
    "bad",
    [
        {"max_entries": 0},
        {"max_bytes": 0},
        {"max_scan": 0},
        {"ttl_seconds": 0},
        {"ttl_seconds": float("nan")},
        {"threshold": 0.0},
        {"threshold": 1.01},
        {"threshold": float("nan")},
    ],
    ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()),
)
def test_settings_out_of_range_are_refused_and_leave_the_index_as_it_was(bad: dict[str, float]) -> None:
    idx = index()
    idx.add("p", [1.0, 0.0], "k")
    settings: dict[str, float] = {"max_entries": 100, "ttl_seconds": 60, "threshold": 0.9, **bad}
    with pytest.raises(ValueError, match="are required"):
        idx.configure(**settings)  # type: ignore[arg-type]
    assert idx.max_entries == 100 and idx.threshold == 0.9 and len(idx) == 1


def test_remove_and_clear() -> None:
    idx = index()
    idx.add("p", [1.0, 0.0], "k")
    idx.remove("unknown")  # no error
    assert len(idx) == 1
    idx.add("q", [1.0, 0.0, 0.0], "k2")
    idx.clear()
    assert (len(idx), idx.nbytes, idx.snapshot().partitions) == (0, 0, 0)
    assert idx.lookup("p", [1.0, 0.0]) is None
    assert idx.add("p", [1.0, 0.0], "k")  # usable again
