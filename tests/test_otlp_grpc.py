"""The OTLP/gRPC receiver against the real embedded store, fed by the official OTLP/gRPC exporters and raw gRPC calls."""

from __future__ import annotations

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from stagetrace.exporters.clickhouse import COLUMNS, ClickHouseSpanExporter
from stagetrace.exporters.otlp import OtlpReceiver
from stagetrace.exporters.otlp_grpc import RETRY_INFO, OtlpGrpcServer

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
TOKEN = "grpc-s3cret"


@pytest.fixture
def receiver(store):
    core = OtlpReceiver(store, None, max_delay_s=0.05, max_body_bytes=64 * 1024, max_queued_spans=50)
    server = OtlpGrpcServer(core, "127.0.0.1:0")
    yield core, server
    server.close()
    core.close()


@pytest.fixture
def guarded(store):
    core = OtlpReceiver(store, None, token=TOKEN, max_delay_s=0.05)
    server = OtlpGrpcServer(core, "127.0.0.1:0")
    yield core, server
    server.close()
    core.close()


def spans(count: int = 3, prefix: str = "g") -> list:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "rag-api", "host.name": "node-a"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("app", "1.0")
    for i in range(count):
        with tracer.start_as_current_span("root", attributes={"stagetrace.request.id": f"{prefix}-{i}", "n": i,
                                                              "list": [1.5, 2.0]}):  # fmt: skip
            with tracer.start_as_current_span("child", attributes={"stagetrace.stage": "decode"}):
                pass
    provider.shutdown()
    return list(memory.get_finished_spans())


def exporter(server, **kwargs) -> OTLPSpanExporter:
    return OTLPSpanExporter(endpoint=f"http://{server.url}", insecure=True, timeout=5, **kwargs)


def stored(store) -> int:
    return int(store.client.command("SELECT count() FROM stagetrace.otel_traces"))


def call(server, body: bytes, metadata=()) -> tuple[grpc.StatusCode, bytes | None, dict]:
    """A raw unary call, so status codes and trailers are seen exactly as sent."""
    with grpc.insecure_channel(server.url) as channel:
        method = channel.unary_unary(EXPORT, request_serializer=None, response_deserializer=None)
        try:
            response, state = method.with_call(body, metadata=metadata, timeout=10)
            return state.code(), response, dict(state.trailing_metadata() or ())
        except grpc.RpcError as error:
            return error.code(), None, dict(error.trailing_metadata() or ())


@pytest.mark.parametrize("compression", [grpc.Compression.NoCompression, grpc.Compression.Gzip], ids=["plain", "gzip"])
def test_the_official_exporter_plain_and_gzip_gives_the_python_exporter_s_columns(store, receiver, compression):
    core, server = receiver
    sent = spans()
    direct = ClickHouseSpanExporter(store=store, create_schema=False)
    assert direct.export(sent) is SpanExportResult.SUCCESS and direct.force_flush()
    assert exporter(server, compression=compression).export(sent) is SpanExportResult.SUCCESS
    assert core.spans.force_flush()
    columns = ", ".join(f"`{c}`" for c in COLUMNS)
    rows: dict[str, list] = {}
    for row in store.client.query(f"SELECT {columns} FROM stagetrace.otel_traces").result_rows:
        rows.setdefault(row[COLUMNS.index("SpanId")], []).append(row)
    assert len(rows) == len(sent) == 6
    assert all(first == second for first, second in rows.values())
    direct.shutdown()


def test_metrics_over_grpc_land_in_the_collector_s_tables(store, receiver):
    core, server = receiver
    reader = InMemoryMetricReader()
    meter = MeterProvider(resource=Resource.create({"service.name": "svc"}), metric_readers=[reader]).get_meter("m")
    meter.create_counter("requests_total").add(3, {"route": "/v1"})
    meter.create_histogram("latency").record(1.0)
    data = reader.get_metrics_data()
    assert OTLPMetricExporter(endpoint=f"http://{server.url}", insecure=True).export(data).name == "SUCCESS"
    assert store.client.query("SELECT MetricName, Value, Attributes['route'] FROM stagetrace.otel_metrics_sum"
                              ).result_rows == [("requests_total", 3.0, "/v1")]  # fmt: skip


def test_a_wrong_or_missing_token_is_unauthenticated_and_nothing_is_stored(store, guarded):
    core, server = guarded
    body = ExportTraceServiceRequest().SerializeToString()
    assert call(server, body)[0] is grpc.StatusCode.UNAUTHENTICATED
    assert call(server, body, (("authorization", "Bearer nope"),))[0] is grpc.StatusCode.UNAUTHENTICATED
    assert exporter(server).export(spans()) is SpanExportResult.FAILURE
    assert exporter(server, headers={"authorization": f"Bearer {TOKEN}"}).export(spans(1, "ok")) is SpanExportResult.SUCCESS
    assert core.spans.force_flush()
    assert store.client.query("SELECT RequestId FROM stagetrace.stagetrace_requests").result_rows == [("ok-0",)]


def test_a_message_over_the_limit_is_resource_exhausted_without_retry_info(receiver):
    _, server = receiver
    code, _, trailers = call(server, b"\x0a" + b"\xff\xff\x07" + bytes(130_000))
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "google.rpc.retryinfo-bin" not in trailers


def test_a_malformed_message_is_invalid_argument_and_the_next_batch_is_taken(store, receiver):
    core, server = receiver
    code, _, _ = call(server, b"\x0a\x05\x0a\x03\xff")
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert exporter(server).export(spans(2)) is SpanExportResult.SUCCESS
    assert core.spans.force_flush() and stored(store) == 4


def test_invalid_ids_are_a_partial_success_and_the_valid_spans_are_kept(store, receiver):
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    core, server = receiver
    request = encode_spans(spans(2))
    request.resource_spans[0].scope_spans[0].spans[0].trace_id = bytes(16)
    code, body, _ = call(server, request.SerializeToString())
    answer = ExportTraceServiceResponse.FromString(body)
    assert code is grpc.StatusCode.OK and answer.partial_success.rejected_spans == 1
    assert core.spans.force_flush() and stored(store) == 3


def test_a_full_queue_is_unavailable_with_retry_info_and_drains_when_the_store_recovers(store):
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    # in memory: with a spool, failed batches leave the queue for disk (tests/test_spool.py)
    core = OtlpReceiver(store, None, max_queued_spans=6, max_delay_s=0.05, spool_dir=False)
    server = OtlpGrpcServer(core, "127.0.0.1:0")
    insert = store.client.insert

    def failing(*args, **kwargs):
        raise ConnectionError("store down")

    try:
        assert call(server, encode_spans(spans(4)).SerializeToString())[0] is grpc.StatusCode.RESOURCE_EXHAUSTED
        store.client.insert = failing
        batch = encode_spans(spans(1)).SerializeToString()  # two spans
        for _ in range(3):
            assert call(server, batch)[0] is grpc.StatusCode.OK  # queued while the store is down
        code, _, trailers = call(server, batch)
        assert code is grpc.StatusCode.UNAVAILABLE and trailers["google.rpc.retryinfo-bin"] == RETRY_INFO
        store.client.insert = insert
        assert core.spans.force_flush(60_000) and stored(store) == 6
        assert call(server, batch)[0] is grpc.StatusCode.OK
    finally:
        store.client.insert = insert
        server.close()
        core.close()
