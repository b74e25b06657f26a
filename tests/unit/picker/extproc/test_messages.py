"""Envoy ext_proc messages as the picker builds and reads them: overwriting headers, immediate answers, the pick in
each phase, streamed body chunks at Envoy's size limit, the subset hint's two encodings, the served endpoint and
the sampled-response mode override."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import given
from hypothesis import strategies as st

from picker.extproc.messages import (
    DEST_HEADER,
    MAX_STREAMED_CHUNK,
    SERVED_KEY,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    header_value,
    immediate,
    pick_response,
    response_headers_answer,
    sampled_headers_answer,
    served_endpoint,
    streamed_chunks,
    subset_hint,
)

OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def headers_of(mutation: pb.HeaderMutation) -> dict[str, str]:
    assert all(o.append_action == OVERWRITE for o in mutation.set_headers)  # a client's value never survives
    return {o.header.key: header_value(o.header) for o in mutation.set_headers}


def test_header_value_prefers_raw_bytes_and_survives_invalid_utf8() -> None:
    assert header_value(base_pb2.HeaderValue(key="k", raw_value=b"raw", value="plain")) == "raw"
    assert header_value(base_pb2.HeaderValue(key="k", value="plain")) == "plain"
    assert header_value(base_pb2.HeaderValue(key="k", raw_value=b"a\xffb")) == "a\ufffdb"


def test_an_immediate_answer_carries_status_body_details_and_json_by_default() -> None:
    r = immediate(503, b'{"error":1}', "kv_epp_no_backend")
    a = r.immediate_response
    assert (a.status.code, a.body, a.details) == (503, b'{"error":1}', "kv_epp_no_backend")
    assert headers_of(a.headers) == {"content-type": "application/json"}
    cached = immediate(200, b"x", "hit", (("content-type", "text/plain"), ("x-cache", "HIT")))
    assert headers_of(cached.immediate_response.headers) == {"content-type": "text/plain", "x-cache": "HIT"}


def test_the_pick_answers_the_phase_it_was_made_in() -> None:
    on_headers = pick_response("10.0.0.1:80", 1234, on_body=False)
    assert on_headers.WhichOneof("response") == "request_headers"
    common = on_headers.request_headers.response
    assert headers_of(common.header_mutation) == {DEST_HEADER: "10.0.0.1:80", "content-length": "1234"}
    assert common.clear_route_cache

    on_body = pick_response("10.0.0.1:80,10.0.0.2:80", None, on_body=True)
    assert on_body.WhichOneof("response") == "request_body"
    common = on_body.request_body.response
    assert headers_of(common.header_mutation) == {DEST_HEADER: "10.0.0.1:80,10.0.0.2:80"}  # no length: not re-sent
    assert common.clear_route_cache
    assert on_body.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST_HEADER].string_value == (
        "10.0.0.1:80,10.0.0.2:80"
    )


def test_a_body_within_the_limit_is_one_chunk_in_the_phase_asked_for() -> None:
    (req,) = streamed_chunks(b"x" * MAX_STREAMED_CHUNK, True, request=True)
    sr = req.request_body.response.body_mutation.streamed_response
    assert len(sr.body) == MAX_STREAMED_CHUNK and sr.end_of_stream
    (resp,) = streamed_chunks(b"", False, request=False)
    assert resp.WhichOneof("response") == "response_body"
    assert not resp.response_body.response.body_mutation.streamed_response.end_of_stream


@given(n=st.integers(0, 4 * MAX_STREAMED_CHUNK + 3), eos=st.booleans())
def test_chunks_reassemble_the_body_within_the_limit_and_only_the_last_ends_it(n: int, eos: bool) -> None:
    body = (bytes(range(251)) * (n // 251 + 1))[:n]
    srs = [r.response_body.response.body_mutation.streamed_response for r in streamed_chunks(body, eos, request=False)]
    assert b"".join(s.body for s in srs) == body
    assert all(0 < len(s.body) <= MAX_STREAMED_CHUNK for s in srs) or (n == 0 and len(srs) == 1)
    assert len(srs) == max(1, -(-n // MAX_STREAMED_CHUNK))
    assert [s.end_of_stream for s in srs] == [False] * (len(srs) - 1) + [eos]


def with_hint(value: object) -> pb.ProcessingRequest:
    req = pb.ProcessingRequest(request_headers=pb.HttpHeaders())
    fields = req.metadata_context.filter_metadata[SUBSET_NAMESPACE].fields
    if isinstance(value, list):
        for v in value:
            fields[SUBSET_KEY].list_value.values.add().string_value = v
    elif isinstance(value, str):
        fields[SUBSET_KEY].string_value = value
    elif isinstance(value, float):
        fields[SUBSET_KEY].number_value = value
    return req


def test_the_subset_hint_is_read_as_a_list_or_a_comma_separated_string() -> None:
    assert subset_hint(with_hint(["10.0.0.1:80", "", "10.0.0.2:80"])) == ["10.0.0.1:80", "10.0.0.2:80"]
    assert subset_hint(with_hint(" 10.0.0.1:80 , ,10.0.0.2:80,")) == ["10.0.0.1:80", "10.0.0.2:80"]
    assert subset_hint(with_hint(1.0)) == []  # present but unreadable: an empty subset, not "no hint"


def test_no_subset_hint_is_none() -> None:
    assert subset_hint(pb.ProcessingRequest()) is None
    other = pb.ProcessingRequest()
    other.metadata_context.filter_metadata["envoy.lb"].fields[SUBSET_KEY].string_value = "10.0.0.1:80"
    assert subset_hint(other) is None  # the key in another namespace
    empty_ns = pb.ProcessingRequest()
    empty_ns.metadata_context.filter_metadata[SUBSET_NAMESPACE].SetInParent()
    assert subset_hint(empty_ns) is None


def test_the_served_endpoint_must_be_a_non_blank_string() -> None:
    req = pb.ProcessingRequest()
    fields = req.metadata_context.filter_metadata["envoy.lb"].fields
    fields[SERVED_KEY].string_value = "  10.0.0.2:80 "
    assert served_endpoint(req) == "10.0.0.2:80"
    fields[SERVED_KEY].string_value = "   "
    assert served_endpoint(req) is None
    fields[SERVED_KEY].number_value = 3.0
    assert served_endpoint(req) is None


def test_response_headers_are_continued_with_x_cache_only_when_given() -> None:
    plain = response_headers_answer(None)
    assert plain.WhichOneof("response") == "response_headers" and not plain.HasField("mode_override")
    assert len(plain.response_headers.response.header_mutation.set_headers) == 0
    assert headers_of(response_headers_answer("MISS").response_headers.response.header_mutation) == {"x-cache": "MISS"}


def test_a_sampled_response_streams_its_body_and_keeps_the_request_side_mode() -> None:
    PM = pm.ProcessingMode
    buffered = sampled_headers_answer(PM.BUFFERED, "BYPASS")
    m = buffered.mode_override
    assert (m.request_body_mode, m.response_body_mode) == (PM.BUFFERED, PM.STREAMED)
    assert (m.request_header_mode, m.response_header_mode, m.response_trailer_mode) == (PM.SEND, PM.SEND, PM.SEND)
    assert m.request_trailer_mode == PM.SKIP
    assert headers_of(buffered.response_headers.response.header_mutation) == {"x-cache": "BYPASS"}
    duplex = sampled_headers_answer(PM.FULL_DUPLEX_STREAMED).mode_override
    assert duplex.request_body_mode == PM.FULL_DUPLEX_STREAMED and duplex.request_trailer_mode == PM.SEND
