"""The OTLP/gRPC receiver against the real embedded store, fed by the official OTLP/gRPC exporters and raw gRPC calls."""

from __future__ import annotations

import gzip
import threading
import time

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricExportResult
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from stagetrace.exporters.clickhouse import COLUMNS, ClickHouseSpanExporter
from stagetrace.exporters.otlp import OtlpReceiver
from stagetrace.exporters.otlp_grpc import RETRY_INFO, OtlpGrpcServer
from tests.test_otlp import recorded_spans, rows_by_span

TRACES = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
METRICS = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
TOKEN = "grpc-s3cret"
LIMIT = 64 * 1024


@pytest.fixture
def receiver(store):
    """The receiver core, serving HTTP too (as in the agent), with the gRPC server in front of it."""
    core = OtlpReceiver(store, "127.0.0.1:0", max_body_bytes=LIMIT, max_spans=50)
    server = OtlpGrpcServer(core, "127.0.0.1:0")
    yield core, server
    server.close()
    core.close()


@pytest.fixture
def guarded(store):
    core = OtlpReceiver(store, None, token=TOKEN)
    server = OtlpGrpcServer(core, "127.0.0.1:0")
    yield core, server
    server.close()
    core.close()


def spans(count: int = 3, prefix: str = "g") -> list:
    """``count`` requests of two spans each from the plain SDK."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "rag-api", "host.name": "node-a"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("app", "1.0")
    for i in range(count):
        with tracer.start_as_current_span("root", attributes={"stagetrace.request.id": f"{prefix}-{i}"}):
            with tracer.start_as_current_span("child", attributes={"stagetrace.stage": "decode"}):
                pass
    provider.shutdown()
    return list(memory.get_finished_spans())


def exporter(server, **kwargs) -> OTLPSpanExporter:
    return OTLPSpanExporter(endpoint=f"http://{server.url}", insecure=True, **{"timeout": 5, **kwargs})


def stored(store) -> int:
    return int(store.client.command("SELECT count() FROM stagetrace.otel_traces"))


def call(server, body: bytes, metadata=(), method: str = TRACES, compression=None):
    """A raw unary call, so status codes and trailers are seen exactly as sent: (code, response bytes, trailers)."""
    with grpc.insecure_channel(server.url) as channel:
        stub = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            response, state = stub.with_call(body, metadata=metadata, timeout=10, compression=compression)
            return state.code(), response, dict(state.trailing_metadata() or ())
        except grpc.RpcError as error:
            return error.code(), None, dict(error.trailing_metadata() or ())


def rich_status(trailers: dict) -> status_pb2.Status:
    return status_pb2.Status.FromString(trailers["grpc-status-details-bin"])


@pytest.mark.parametrize("compression", [grpc.Compression.NoCompression, grpc.Compression.Gzip], ids=["plain", "gzip"])
def test_spans_over_grpc_get_the_columns_of_otlp_http_and_of_the_python_exporter(store, receiver, compression):
    core, server = receiver
    sent = recorded_spans()  # every column: kinds, status, events, links, attribute types
    direct = ClickHouseSpanExporter(store=store, create_schema=False)
    assert direct.export(sent) is SpanExportResult.SUCCESS and direct.force_flush()
    assert HttpSpanExporter(endpoint=f"{core.url}/v1/traces").export(sent) is SpanExportResult.SUCCESS
    assert exporter(server, compression=compression).export(sent) is SpanExportResult.SUCCESS
    assert core.writer.flush()
    rows = rows_by_span(store)
    assert len(rows) == len(sent) == 5
    for span_id, copies in rows.items():
        assert len(copies) == 3 and copies[0] == copies[1] == copies[2], span_id
    root = next(r[0] for r in rows.values() if r[0][COLUMNS.index("SpanName")] == "root")
    assert root[COLUMNS.index("SpanAttributes")]["stagetrace.request.id"] == "r-1"
    direct.shutdown()


def test_metrics_over_grpc_land_in_the_collector_s_tables_and_histograms_are_a_partial_success(store, receiver):
    _, server = receiver
    reader = InMemoryMetricReader()
    meter = MeterProvider(resource=Resource.create({"service.name": "svc"}), metric_readers=[reader]).get_meter("m")
    meter.create_counter("requests_total").add(3, {"route": "/v1"})
    meter.create_histogram("latency").record(1.0)
    data = reader.get_metrics_data()
    grpc_exporter = OTLPMetricExporter(endpoint=f"http://{server.url}", insecure=True, timeout=5)
    assert grpc_exporter.export(data) is MetricExportResult.SUCCESS
    assert receiver[0].writer.flush()
    assert store.client.query(
        "SELECT MetricName, Value, Attributes['route'] FROM stagetrace.otel_metrics_sum"
    ).result_rows == [("requests_total", 3.0, "/v1")]
    # the SDK exporter does not read partial_success: a raw call does
    code, body, _ = call(server, encode_metrics(data).SerializeToString(), method=METRICS)
    answer = ExportMetricsServiceResponse.FromString(body).partial_success
    assert code is grpc.StatusCode.OK and answer.rejected_data_points == 1 and "histogram" in answer.error_message


def test_a_wrong_or_missing_token_is_unauthenticated_and_nothing_is_stored(store, guarded):
    core, server = guarded
    body = encode_spans(spans(1, "raw")).SerializeToString()
    assert call(server, body)[0] is grpc.StatusCode.UNAUTHENTICATED
    assert call(server, body, (("authorization", "Bearer nope"),))[0] is grpc.StatusCode.UNAUTHENTICATED
    assert call(server, body, (("authorization", TOKEN),))[0] is grpc.StatusCode.UNAUTHENTICATED  # no scheme
    assert call(server, body, method=METRICS)[0] is grpc.StatusCode.UNAUTHENTICATED
    assert exporter(server).export(spans(1, "no")) is SpanExportResult.FAILURE
    assert (
        exporter(server, headers=(("authorization", "Bearer nope"),)).export(spans(1, "no")) is SpanExportResult.FAILURE
    )
    assert core.writer.flush() and stored(store) == 0
    with_token = exporter(server, headers=(("authorization", f"Bearer {TOKEN}"),))
    assert with_token.export(spans(1, "ok")) is SpanExportResult.SUCCESS
    assert core.writer.flush()
    assert store.client.query("SELECT RequestId FROM stagetrace.stagetrace_requests").result_rows == [("ok-0",)]


@pytest.mark.parametrize("compression", [None, grpc.Compression.Gzip], ids=["plain", "gzip-inflated"])
def test_a_message_over_the_limit_is_resource_exhausted_without_retry_info(store, receiver, compression):
    core, server = receiver
    # one span whose attribute value alone is over the limit; gzip shrinks it far below, the check is on inflated
    request = encode_spans(spans(1))
    request.resource_spans[0].scope_spans[0].spans[0].attributes.add(key="big").value.string_value = "x" * (LIMIT + 1)
    body = request.SerializeToString()
    assert len(gzip.compress(body)) < LIMIT // 10 < LIMIT < len(body)
    code, _, trailers = call(server, body, compression=compression)
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "google.rpc.retryinfo-bin" not in trailers
    assert call(server, encode_spans(spans(1)).SerializeToString(), compression=compression)[0] is grpc.StatusCode.OK
    assert core.writer.flush() and stored(store) == 2  # only the second call's spans


def test_more_spans_than_the_queue_holds_is_final_resource_exhausted(store, receiver):
    core, server = receiver
    code, _, trailers = call(server, encode_spans(spans(26)).SerializeToString())  # 52 spans, the queue holds 50
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "google.rpc.retryinfo-bin" not in trailers
    assert "send smaller batches" in rich_status(trailers).message and not rich_status(trailers).details
    assert core.writer.flush() and stored(store) == 0


@pytest.mark.parametrize("method", [TRACES, METRICS])
def test_a_malformed_message_is_invalid_argument_and_the_next_batch_is_taken(store, receiver, method):
    core, server = receiver
    code, _, trailers = call(server, b"\x0a\x05\x0a\x03\xff", method=method)  # a length running past the end
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert rich_status(trailers).code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert exporter(server).export(spans(2)) is SpanExportResult.SUCCESS
    assert core.writer.flush() and stored(store) == 4


def test_invalid_ids_are_a_partial_success_and_the_valid_spans_are_kept(store, receiver):
    core, server = receiver
    request = encode_spans(spans(2))
    request.resource_spans[0].scope_spans[0].spans[0].trace_id = bytes(16)
    request.resource_spans[0].scope_spans[0].spans[1].span_id = bytes(8)
    code, body, _ = call(server, request.SerializeToString())
    answer = ExportTraceServiceResponse.FromString(body).partial_success
    assert (
        code is grpc.StatusCode.OK and answer.rejected_spans == 2 and "invalid trace or span ID" in answer.error_message
    )
    assert core.writer.flush() and stored(store) == 2
    # a fully taken call answers an empty response, as over HTTP
    code, body, _ = call(server, ExportTraceServiceRequest().SerializeToString())
    assert code is grpc.StatusCode.OK and ExportTraceServiceResponse.FromString(body) == ExportTraceServiceResponse()


def assert_retry_later(code, trailers) -> None:
    assert code is grpc.StatusCode.UNAVAILABLE
    assert trailers["google.rpc.retryinfo-bin"] == RETRY_INFO
    delay = error_details_pb2.RetryInfo.FromString(RETRY_INFO).retry_delay
    assert (delay.seconds, delay.nanos) == (2, 0)
    rich = rich_status(trailers)
    assert rich.code == grpc.StatusCode.UNAVAILABLE.value[0] and len(rich.details) == 1
    info = error_details_pb2.RetryInfo()
    assert rich.details[0].Unpack(info) and info.retry_delay == delay


def test_a_store_down_without_a_spool_is_unavailable_with_retry_info_and_the_official_exporter_retries(store):
    # without a spool nothing can hold the spans, so the call is refused; with one they go to disk (test_spool.py)
    core = OtlpReceiver(store, None, spool_dir=False)
    server = OtlpGrpcServer(core, "127.0.0.1:0")
    insert = store.client.insert

    def failing(*args, **kwargs):
        raise ConnectionError("store down")

    try:
        store.client.insert = failing
        batch = encode_spans(spans(1)).SerializeToString()  # two spans
        assert_retry_later(*call(server, batch)[::2])  # never OK for spans that are nowhere
        assert stored(store) == 0
        # the store comes back while the official exporter waits the delay it was given
        threading.Timer(0.5, setattr, (store.client, "insert", insert)).start()
        started = time.monotonic()
        assert exporter(server, timeout=10).export(spans(1, "late")) is SpanExportResult.SUCCESS
        assert time.monotonic() - started > 1.5  # RetryInfo's 2 s, less the exporter's jitter
        assert stored(store) == 2  # answered OK: already stored
    finally:
        store.client.insert = insert
        server.close()
        core.close()


def test_metric_points_a_store_refuses_are_spooled_or_else_unavailable_with_retry_info(store, receiver):
    core, server = receiver
    bare = OtlpReceiver(store, None, spool_dir=False)
    bare_server = OtlpGrpcServer(bare, "127.0.0.1:0")
    reader = InMemoryMetricReader()
    MeterProvider(metric_readers=[reader]).get_meter("m").create_counter("c").add(1)
    body = encode_metrics(reader.get_metrics_data()).SerializeToString()
    insert = store.client.insert

    def failing(*args, **kwargs):
        raise ConnectionError("store down")

    store.client.insert = failing
    try:
        assert_retry_later(*call(bare_server, body, method=METRICS)[::2])  # nowhere to keep them: refused
        assert call(server, body, method=METRICS)[0] is grpc.StatusCode.OK  # fsynced in the spool
        assert core.writer.spooled_rows() == 1
    finally:
        store.client.insert = insert
        bare_server.close()
        bare.close()
    assert core.writer.flush()
    assert store.client.command("SELECT count() FROM stagetrace.otel_metrics_sum") == 1


def test_a_taken_port_is_an_os_error_naming_the_reason(receiver):
    _, server = receiver
    with pytest.raises(OSError, match="Address already in use"):
        OtlpGrpcServer(receiver[0], server.url)
