"""Engines' own traces, recorded from their released tracing code (tests/fixtures/sglang/README.md), sent over
OTLP/HTTP into a running receiver and read from the real store (issue 53)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from stagetrace.exporters.otlp import OtlpReceiver

# every span these tests store is also the corpus of the views' rows (tests/views_reference.py)
pytestmark = pytest.mark.views_row_for_row

SGLANG = Path(__file__).parent / "fixtures" / "sglang"
RID = "3f9a1c2e8b7d4e6fa0b1c2d3e4f5a6b7"


@pytest.fixture
def receiver(store):
    r = OtlpReceiver(store, "127.0.0.1:0")
    yield r
    r.close()


def send(receiver, scenario: str) -> None:
    """Post each export request SGLang's exporter sent, as it sent it (protobuf over HTTP)."""
    for message in json.loads((SGLANG / f"{scenario}.json").read_text()):
        body = json_format.ParseDict(message, ExportTraceServiceRequest()).SerializeToString()
        request = urllib.request.Request(f"{receiver.url}/v1/traces", data=body, method="POST",
                                         headers={"Content-Type": "application/x-protobuf"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200
    receiver.writer.flush()


def stages(store) -> list[tuple]:
    return store.client.query("SELECT SpanName, Stage, Rank, ServiceName FROM stagetrace.stagetrace_stages "
                              "ORDER BY SpanName, Rank").result_rows  # fmt: skip


def test_sglang_tp2_stages_are_per_rank(store, receiver):
    """With TP=2 SGLang records tp_rank only on each scheduler thread's span: each stage span below it is its rank's,
    so the decode stage is two keys (rank 0, rank 1), not one holding both ranks' spans."""
    send(receiver, "unified-tp2")
    rows = stages(store)
    assert [(n, s, r) for n, s, r, _ in rows if n in ("prefill_forward", "decode_forward", "decode_loop")] == [
        ("decode_forward", "decode", "0"), ("decode_forward", "decode", "1"),
        ("decode_loop", "decode", "0"), ("decode_loop", "decode", "1"),
        ("prefill_forward", "decode", "0"), ("prefill_forward", "decode", "1"),
    ]  # fmt: skip
    # the tokenizer thread has no rank: its stage keeps none
    assert [r for n, _, r, _ in rows if n == "tokenize"] == [""]
    # the spans as stored carry the inherited rank under stagetrace's name, and SGLang's own attributes unchanged
    stored = dict(store.client.query("SELECT SpanName, SpanAttributes FROM stagetrace.otel_traces WHERE "
                                     "position(SpanName, '[TP 1]') > 0 OR SpanName = 'tokenize'").result_rows)
    assert stored["tokenize"] == {}
    assert [a["tp_rank"] for n, a in stored.items() if n != "tokenize"] == ["1"]


def test_sglang_sampled_request_without_an_exported_seed_is_not_called_nondeterministic(store, receiver):
    """SGLang exports temperature 0.7 but never the seed: the seed is unknown, so the request is not excused as
    sampling nondeterminism on temperature alone (the fixture's request may have been sent with seed=42)."""
    send(receiver, "unified-tp2")
    rows = store.client.query("SELECT RequestId, Nondeterministic FROM stagetrace.stagetrace_requests").result_rows
    assert rows == [(RID, "")]


def test_a_disaggregated_request_is_found_by_its_id_with_its_prefill_and_its_decode(store, receiver):
    """SGLang's prefill and decode servers each open a root with the request's rid, in two traces (no traced
    router): looked up by that rid, the request is both halves, the prefill's forward pass and KV transfer beside the
    decode's, while the mooncake sender's root (no request) is no third half. Beside it another service's request
    whose ID is the same rid, retried: its earlier try is not shown (the latest of a retried request stands)."""
    from stagetrace import lookup

    send(receiver, "prefill")
    send(receiver, "decode")
    trace = lookup.by_request_id(store, RID)
    names = {span.name for span in trace.spans}
    assert {"prefill_forward", "prefill_transfer_kv_cache", "decode_forward", "decode_transferred"} <= names, names
    roots = {span.name.split(" Req ")[0] for span in trace.spans if not span.parent_span_id and " Req " in span.name}
    assert {"prefill", "decode"} <= roots, roots
    assert len(trace.spans) == len({(s.span_id, s.start_ns) for s in trace.spans})  # each span once
    # each half's spans keep their own tree: a parent is never shown below its child
    position = {span.span_id: n for n, span in enumerate(trace.spans)}
    assert all(position[s.parent_span_id] < position[s.span_id] for s in trace.spans if s.parent_span_id in position)
    # the neighbour: an ordinary request retried under one ID shows its latest try only
    retried = "neighbour-retried"
    for attempt in range(2):
        message = ExportTraceServiceRequest()
        scope = message.resource_spans.add().scope_spans.add()
        span = scope.spans.add(name=f"attempt-{attempt}", trace_id=(attempt + 7).to_bytes(16, "big"),
                               span_id=(attempt + 7).to_bytes(8, "big"), start_time_unix_nano=10**18 + attempt * 10**9,
                               end_time_unix_nano=10**18 + attempt * 10**9 + 1000)  # fmt: skip
        span.attributes.add(key="stagetrace.request.id", value={"string_value": retried})
        request = urllib.request.Request(f"{receiver.url}/v1/traces", data=message.SerializeToString(), method="POST",
                                         headers={"Content-Type": "application/x-protobuf"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200
    receiver.writer.flush()
    assert [s.name for s in lookup.by_request_id(store, retried).spans] == ["attempt-1"]


def test_the_kv_transfer_of_a_disaggregated_request_is_its_cache_stage(store, receiver):
    """The KV cache moved from the prefill server to the decode server (SGLang's bootstrap and transfer spans, and
    mooncake's) is the cache stage of each half; the forward passes stay decode, the threads and roots no stage."""
    send(receiver, "prefill")
    send(receiver, "decode")
    by_name = {name: stage for name, stage, _, _ in stages(store)}
    assert {n: by_name.get(n) for n in ("prefill_bootstrap", "prefill_transfer_kv_cache", "decode_bootstrap",
                                        "decode_transferred", "mooncake_transfer_kv")} == dict.fromkeys(
        ("prefill_bootstrap", "prefill_transfer_kv_cache", "decode_bootstrap", "decode_transferred",
         "mooncake_transfer_kv"), "cache")  # fmt: skip
    assert by_name["prefill_forward"] == by_name["decode_forward"] == "decode"
    assert not any(" Req " in name or "Scheduler" in name for name in by_name), by_name
