"""OTLP ingest into the agent's receiver: the official OTLP/gRPC exporter beside the official OTLP/HTTP exporter.

One receiver core with both front-ends (``OtlpReceiver`` for HTTP, ``OtlpGrpcServer`` for gRPC) on the embedded
store, as ``stagetrace agent`` runs them. The same prepared spans (six per request, the span API's shape) go
through each exporter in the SDK's 512-span batches, protocols alternating; the clock stops when the
receiver says every span is in ``otel_traces`` (each request is answered once its spans are stored). Medians of the runs; the ratio is gRPC's spans/s to HTTP's.

Sender and receiver share the process (and its GIL), so the figure is the whole path: the SDK's encoder
(about 50 µs a span, measured), the transport, and the receiver's decoding, rows and inserts, which both
protocols share. The ratio therefore shows what the transport adds, not what the receiver alone could take.
"""

from __future__ import annotations

import statistics
import tempfile
import time

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.trace.export import SpanExportResult

from benchmarks import Figure, benchmark
from benchmarks.export import make_spans
from stagetrace.exporters.otlp import OtlpReceiver
from stagetrace.exporters.otlp_grpc import OtlpGrpcServer
from stagetrace.store import open_store

BATCH = 512  # the SDK's BatchSpanProcessor max_export_batch_size


@benchmark("otlp_ingest")
def otlp_ingest(quick: bool) -> list[Figure]:
    requests, runs = (500, 1) if quick else (10_000, 3)
    spans = make_spans(requests)
    batches = [spans[i : i + BATCH] for i in range(0, len(spans), BATCH)]
    with (
        tempfile.TemporaryDirectory(prefix="stagetrace-bench-") as directory,
        open_store(f"chdb://{directory}") as store,
    ):
        core = OtlpReceiver(store, "127.0.0.1:0")  # writes ahead into the spool beside the store, as the agent
        server = OtlpGrpcServer(core, "127.0.0.1:0")
        exporters = {
            "gRPC": GrpcExporter(endpoint=f"http://{server.url}", insecure=True),
            "HTTP": HttpExporter(endpoint=f"{core.url}/v1/traces"),
        }
        seconds: dict[str, list[float]] = {name: [] for name in exporters}
        try:
            for _ in range(runs):
                for name, exporter in exporters.items():
                    started = time.perf_counter()
                    for batch in batches:
                        assert exporter.export(batch) is SpanExportResult.SUCCESS
                    assert core.writer.flush(120)
                    seconds[name].append(time.perf_counter() - started)
        finally:
            for exporter in exporters.values():
                exporter.shutdown()
            server.close()
            core.close()
    rate = {name: len(spans) / statistics.median(values) for name, values in seconds.items()}
    return [
        Figure(
            f"OTLP/gRPC ingest of {len(spans):,} spans (official exporter, 512-span batches)",
            rate["gRPC"],
            "spans/s",
            "OTLP/HTTP, same spans",
            rate["HTTP"],
        )
    ]
