"""Session affinity's table: an entry lives ``ttl_seconds`` from its last write (a read does not extend it, the
expiry instant itself is expired), the least recently used entry goes first beyond ``max_sessions``, and an
expired entry is removed when read."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from picker.request.sessions import SessionTable


def test_an_entry_expires_at_its_ttl_and_a_read_does_not_extend_it() -> None:
    t = SessionTable(max_sessions=10, ttl_seconds=5)
    t.put(b"s", "a", now=100.0)
    assert t.get(b"s", 104.999) == "a"
    assert t.get(b"s", 105.0) is None  # the expiry instant is expired
    assert len(t) == 0  # removed on that read
    assert t.get(b"s", 100.0) is None  # gone for good, whatever the clock says


def test_a_write_moves_the_session_and_restarts_its_ttl() -> None:
    t = SessionTable(max_sessions=10, ttl_seconds=5)
    t.put(b"s", "a", now=0.0)
    t.put(b"s", "b", now=4.0)
    assert len(t) == 1 and t.get(b"s", 8.0) == "b" and t.get(b"s", 9.0) is None


def test_a_read_makes_an_entry_the_most_recently_used() -> None:
    t = SessionTable(max_sessions=2, ttl_seconds=60)
    t.put(b"old", "a", now=0.0)
    t.put(b"new", "b", now=1.0)
    assert t.get(b"old", 2.0) == "a"  # "new" is now the least recently used
    t.put(b"third", "c", now=3.0)
    assert (t.get(b"old", 4.0), t.get(b"new", 4.0), t.get(b"third", 4.0)) == ("a", None, "c")


def test_an_unknown_session_is_none() -> None:
    assert SessionTable(max_sessions=1, ttl_seconds=1).get(b"nobody", 0.0) is None


ops = st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(0, 3)), max_size=60)


@given(ops=ops, cap=st.integers(1, 4))
def test_the_table_agrees_with_a_simple_lru_model_and_never_outgrows_its_bound(
    ops: list[tuple[bool, int, int]], cap: int
) -> None:
    t = SessionTable(max_sessions=cap, ttl_seconds=10)
    model: list[tuple[bytes, str, float]] = []  # least recently used first: (session, name, expires)
    now = 0.0
    for write, session, step in ops:
        now += step
        key = bytes([session])
        found = next((m for m in model if m[0] == key), None)
        if write:
            if found:
                model.remove(found)
            model.append((key, f"e{session}", now + 10))
            del model[: max(0, len(model) - cap)]
            t.put(key, f"e{session}", now)
        else:
            expected = None
            if found:
                model.remove(found)
                if now < found[2]:
                    model.append(found)
                    expected = found[1]
            assert t.get(key, now) == expected
        assert len(t) == len(model) <= cap
