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
