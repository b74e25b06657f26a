"""The assignment of sessions to arms: stable across processes, by weight, by the session's key (a header, else
the conversation's first turn); the turn table's gaps and its bound."""

from __future__ import annotations

import random

from picker.experiments.assign import (
    SOURCE_FIRST_TURN,
    SOURCE_HEADER,
    SOURCE_NONE,
    Assigner,
    SessionTurns,
    session_of,
)
from picker.facts import RequestFacts

HEADERS = ("x-session-id", "x-claude-code-session-id", "session_id")


def facts(system: str | None = None, first: str | None = None) -> RequestFacts:
    return RequestFacts(api="chat", model="m", system=system, first_message=first)


def test_a_session_header_names_the_session_whatever_the_header() -> None:
    a = session_of({"x-session-id": "s1"}, facts(first="hello"), HEADERS)
    b = session_of({"session_id": "s1"}, facts(first="other"), HEADERS)
    assert a.source == b.source == SOURCE_HEADER
    assert a.digest == b.digest and a.id == b.id and len(a.id) == 16
    assert session_of({"x-session-id": "s2"}, facts(first="hello"), HEADERS).digest != a.digest
    assert "s1" not in a.id  # the log records a hash, never the raw header


def test_without_a_header_the_first_turn_is_the_session() -> None:
    one = session_of({}, facts("sys", "first question"), HEADERS)
    again = session_of({}, facts("sys", "first question"), HEADERS)  # a later turn repeats system + first message
    other = session_of({}, facts("sys", "another question"), HEADERS)
    assert one.source == SOURCE_FIRST_TURN and one.digest == again.digest != other.digest
    ids = RequestFacts(api="completions", prompt_token_ids=(1, 2, 3))
    assert session_of({}, ids, HEADERS).source == SOURCE_FIRST_TURN


def test_nothing_to_key_on_is_a_session_of_its_own() -> None:
    a = session_of({}, RequestFacts(api="other"), HEADERS)
    b = session_of({}, RequestFacts(api="other"), HEADERS)
    assert a.source == SOURCE_NONE and a.digest != b.digest


def test_the_same_session_lands_in_the_same_arm_in_another_process() -> None:
    weights = {"a": 1.0, "b": 1.0}
    first, second = Assigner("exp-1", weights), Assigner("exp-1", dict(reversed(weights.items())))
    keys = [session_of({"x-session-id": f"s{i}"}, facts(), HEADERS).digest for i in range(2000)]
    assert [first.arm(k) for k in keys] == [second.arm(k) for k in keys]
    assert {first.arm(k) for k in keys} == {"a", "b"}


def test_shares_follow_the_weights() -> None:
    rng = random.Random(7)
    keys = [rng.randbytes(16) for _ in range(20_000)]
    even = Assigner("s", {"a": 1, "b": 1})
    share_a = sum(even.arm(k) == "a" for k in keys) / len(keys)
    assert 0.48 < share_a < 0.52
    skew = Assigner("s", {"a": 3, "b": 1, "c": 0.5})
    counts = {n: sum(skew.arm(k) == n for k in keys) / len(keys) for n in ("a", "b", "c")}
    for name, weight in (("a", 3), ("b", 1), ("c", 0.5)):
        assert abs(counts[name] - weight / 4.5) < 0.02


def test_a_new_salt_draws_the_sessions_again() -> None:
    rng = random.Random(3)
    keys = [rng.randbytes(16) for _ in range(2000)]
    old, new = Assigner("one", {"a": 1, "b": 1}), Assigner("two", {"a": 1, "b": 1})
    moved = sum(old.arm(k) != new.arm(k) for k in keys) / len(keys)
    assert 0.4 < moved < 0.6  # independent draws: about half move


def test_turns_and_gaps() -> None:
    t = SessionTurns(10)
    k = b"k" * 16
    assert t.begin(k, 100.0) == (1, None, None)
    t.end(k, 101.0, completed=True)
    assert t.begin(k, 104.0) == (2, 4.0, 3.0)  # start gap from the last start, idle gap from its end
    assert t.begin(k, 104.5) == (3, 0.5, None)  # a parallel request: no idle gap
    t.end(k, 105.0, completed=True)
    assert t.begin(k, 106.0)[2] is None  # one of the session's requests is still in flight
    t.end(k, 107.0, completed=False)
    t.end(k, 107.5, completed=False)
    assert t.begin(k, 108.0)[2] is None  # the last one did not complete: no idle gap


def test_the_turn_table_is_bounded_least_recent_first() -> None:
    t = SessionTurns(3)
    for i in range(5):
        t.begin(bytes([i]) * 16, float(i))
    assert len(t) == 3
    assert t.begin(bytes([0]) * 16, 9.0)[0] == 1  # dropped: it starts again
    assert t.begin(bytes([4]) * 16, 9.0)[0] == 2
