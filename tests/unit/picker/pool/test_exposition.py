"""The Prometheus text parser's contract: a sample line round-trips whatever its label values, reading only the
wanted families gives the same samples as reading all and filtering, the sample and type bounds, what is skipped
versus dropped versus ignored, and that no text makes it raise."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from picker.pool.exposition import Exposition, Sample, parse_exposition, parse_sample

NAMES = ("m", "m_total", "ns:m", "other")  # "m" is a prefix of two others


def render(name: str, labels: dict[str, str], value: float) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    inner = ",".join(f'{k}="{esc(v)}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {value!r}" if labels else f"{name} {value!r}"


@given(
    name=st.sampled_from(NAMES),
    labels=st.dictionaries(
        st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,8}", fullmatch=True), st.text(max_size=12), max_size=5
    ),
    value=st.floats(allow_nan=False),
)
def test_a_rendered_sample_parses_back_to_itself(name: str, labels: dict[str, str], value: float) -> None:
    assert parse_sample(render(name, labels, value)) == Sample(name, tuple(sorted(labels.items())), value)


line = st.one_of(
    st.builds(lambda n, v, e: f'{n}{{e="{e}"}} {v}', st.sampled_from(NAMES), st.integers(0, 9), st.sampled_from("xm")),
    st.builds(lambda n: f"# TYPE {n} gauge", st.sampled_from(NAMES)),
    st.builds(lambda n: f"# HELP {n} about m and m_total 3", st.sampled_from(NAMES)),
    st.builds(lambda n: f'other{{note="{n} 5"}} 1', st.sampled_from(NAMES)),  # a name inside a label value
    st.sampled_from(["", "   ", "# free comment m 1", "m{", "m 1_0", "garbage"]),
)


@given(lines=st.lists(line, max_size=30), wanted=st.sets(st.sampled_from(NAMES), min_size=1))
def test_reading_only_the_wanted_families_equals_reading_all_and_filtering(lines: list[str], wanted: set[str]) -> None:
    text = "\n".join(lines)
    full = parse_exposition(text)
    some = parse_exposition(text, frozenset(wanted))

    def key(s: Sample) -> tuple[str, tuple[tuple[str, str], ...], float]:
        return (s.name, s.labels, s.value)

    assert sorted(map(key, some.samples)) == sorted(key(s) for s in full.samples if s.name in wanted)
    assert some.types == {n: t for n, t in full.types.items() if n in wanted}
    assert some.examined <= full.examined and some.skipped <= full.skipped


@given(st.text(max_size=400))
def test_no_text_makes_the_parser_raise(text: str) -> None:
    expo = parse_exposition(text)
    assert expo.examined >= len(expo.samples) + expo.skipped + expo.dropped  # each counted line was examined
    parse_exposition(text, frozenset(NAMES))


def test_beyond_the_sample_bound_lines_are_dropped_unparsed_and_types_are_bounded_too() -> None:
    text = "".join(f"# TYPE f{i} counter\nf{i} {i}\n" for i in range(5)) + "not a sample line\n"
    expo = parse_exposition(text, max_samples=2)
    assert [s.name for s in expo.samples] == ["f0", "f1"]
    assert expo.dropped == 4 and expo.skipped == 0  # the garbage line after the bound is dropped, not parsed
    assert list(expo.types) == ["f0", "f1"]  # at most max_samples declared types kept
    assert expo.examined == 11


def test_blank_lines_are_not_examined_free_comments_are_not_skipped_and_crlf_is_read() -> None:
    text = '\r\n  \n# just a comment\n#HELP glued is a comment too\r\nm{a="1"} 2\r\n# TYPE m sausage\n'
    expo = parse_exposition(text)
    assert expo.samples == [Sample("m", (("a", "1"),), 2.0)]
    assert (expo.examined, expo.skipped) == (4, 1)  # only the TYPE with no metric type is a bad line
    assert expo.types == {}


def test_a_type_of_an_unwanted_family_is_not_kept() -> None:
    text = "# TYPE a gauge\n# TYPE b counter\na 1\nb 2\n"
    expo = parse_exposition(text, frozenset({"b"}))
    assert expo.types == {"b": "counter"} and [s.name for s in expo.samples] == ["b"]


def test_samples_answer_label_and_family_queries() -> None:
    expo = parse_exposition('m{engine="0",model_name="x"} 1\nm{engine="1"} 2\nn 3 1700000000000\n')
    first, second = expo.family("m")
    assert first.label("engine") == "0" and first.label("model_name") == "x" and second.label("model_name") is None
    (n,) = expo.family("n")
    assert n.timestamp_ms == 1_700_000_000_000 and expo.family("absent") == []
    assert Exposition().family("m") == []


def test_nan_and_infinity_are_read_in_either_case_and_with_a_sign() -> None:
    for text, check in (("m NaN", math.isnan), ("m -nan", math.isnan), ("m inf", math.isinf)):
        s = parse_sample(text)
        assert s is not None and check(s.value), text


def test_a_wanted_family_named_inside_the_comment_keyword_keeps_its_type() -> None:
    text = "# HELP P the P family\n# TYPE P gauge\nP 1\n"
    assert parse_exposition(text).types == {"P": "gauge"}
    assert parse_exposition(text, frozenset({"P"})).types == {"P": "gauge"}
