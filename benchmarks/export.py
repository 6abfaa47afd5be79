"""Span export: ``BatchSpanProcessor`` + ``ClickHouseSpanExporter`` into the embedded store, against the ceiling.

The spans are made once beforehand with the SDK (six per request, as the stage-span API makes them) and
handed to ``BatchSpanProcessor.on_end`` as fast as the loop goes; the clock stops when
``force_flush`` of the processor and of the exporter say every span is in ``otel_traces``. The processor
batches as ``stagetrace.configure`` sets it up (``tracing.batching()``: 4,096 spans), and the exporter stores
each batch before it answers. So the figure covers the processor's queue, the exporter's row conversion
(``span_row``) and the inserts themselves, all in one Python process.

The ceiling is a raw columnar ``client.insert`` of the very same rows (converted beforehand, not
timed) at the same insert size: what clickhouse-connect can put into the store at all. The
same insert at the SDK's default 512-span batches is shown for scale. Runs alternate; medians are reported.

The prepared spans and rows are moved out of the cyclic garbage collector's view (``gc.freeze``) while
timing: they stand in for spans an application makes just in time, and left in view, the hundreds of
thousands of them make every collection the exporter's allocations trigger several times slower
(measured: ``span_row`` 23 µs a span with them in view, 11 µs frozen, 8 µs with no collection at all).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import tempfile
import time
import uuid

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind
from stagetrace.exporters.clickhouse import ClickHouseSpanExporter
from stagetrace.exporters.rows import COLUMNS, Resources, span_row

import stagetrace.tracing as st
from benchmarks import Figure, benchmark
from stagetrace.store import open_store

BATCH_ROWS = st.batching().get("max_export_batch_size", 4096)  # what configure() gives the processor


class _Keep(SpanExporter):
    def __init__(self):
        self.spans = []

    def export(self, spans) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS


def make_spans(requests: int) -> list:
    """Finished SDK spans: ``requests`` requests of a root and five stages, with the conventions' attributes."""
    keep = _Keep()
    provider = TracerProvider(resource=Resource.create({"service.name": "bench", "host.name": "bench-0"}))
    provider.add_span_processor(SimpleSpanProcessor(keep))
    tracer = provider.get_tracer("stagetrace")
    for i in range(requests):
        with tracer.start_as_current_span(
            "inference.request",
            kind=SpanKind.SERVER,
            attributes={
                st.REQUEST_ID: f"req-{i}",
                st.INPUT_DIGEST: f"{i:032x}",
                "gen_ai.request.model": "m-7b",
            },
        ) as root:
            for k, stage in enumerate(st.PIPELINE_STAGES):
                with tracer.start_as_current_span(
                    f"stage.{stage}",
                    attributes={
                        st.STAGE: stage,
                        st.STAGE_INPUT_DIGEST: f"{i:030x}{k:02x}",
                        f"setting.{stage}": "a",
                        "gpu.uuid": f"GPU-{i % 8}",
                    },
                ) as span:
                    span.set_attribute(st.STAGE_OUTPUT_DIGEST, f"{i:030x}{k + 1:02x}")
            root.set_attribute(st.OUTPUT_DIGEST, f"{i:032x}"[::-1])
    provider.shutdown()
    return keep.spans


def _exporter_run(store, spans) -> float:
    """Seconds from the first ``on_end`` until every span is in the store."""
    exporter = ClickHouseSpanExporter(store, create_schema=False)
    # no span dropped, all are counted: a queue that holds them all
    processor = BatchSpanProcessor(exporter, max_queue_size=len(spans), max_export_batch_size=BATCH_ROWS)
    started = time.perf_counter()
    for span in spans:
        processor.on_end(span)
    ok = processor.force_flush(120_000) and exporter.force_flush(120_000)
    elapsed = time.perf_counter() - started
    processor.shutdown()
    if not ok or exporter.dropped_spans:
        raise RuntimeError(f"the exporter did not write every span (dropped {exporter.dropped_spans})")
    return elapsed


def _raw_run(store, columns_by_batch) -> float:
    started = time.perf_counter()
    for columns in columns_by_batch:
        # a token of its own, as the exporter gives each insert: the schema's deduplication window would
        # otherwise drop a repeated block of the same rows without writing it
        store.client.insert(
            "otel_traces",
            columns,
            column_names=COLUMNS,
            database=store.database,
            column_oriented=True,
            settings={"insert_deduplication_token": uuid.uuid4().hex},
        )
    return time.perf_counter() - started


def _columnar(rows: list[tuple], size: int) -> list[list]:
    return [list(map(list, zip(*rows[i : i + size]))) for i in range(0, len(rows), size)]


@benchmark("export")
def export(quick: bool) -> list[Figure]:
    requests, rounds = (3_000, 1) if quick else (20_000, 5)
    spans = make_spans(requests)
    n = len(spans)
    resources = Resources()
    rows = [span_row(span, resources) for span in spans]
    big, small = _columnar(rows, BATCH_ROWS), _columnar(rows, 512)
    runs: dict[str, list[float]] = {"exporter": [], "raw": [], "raw512": []}
    gc.collect()
    gc.freeze()
    with contextlib.ExitStack() as stack:
        stack.callback(gc.unfreeze)
        directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="stagetrace-bench-"))
        store = stack.enter_context(open_store(f"chdb://{directory}"))
        _raw_run(store, big[:1])  # warm-up
        for r in range(rounds):
            runs["exporter"].append(n / _exporter_run(store, spans))
            runs["raw"].append(n / _raw_run(store, big))
            if r < 2:
                runs["raw512"].append(n / _raw_run(store, small))
        written = store.client.query(
            "SELECT count() FROM {db:Identifier}.otel_traces", parameters={"db": store.database}
        )
        expected = n * (2 * rounds + min(rounds, 2)) + min(BATCH_ROWS, n)
        if written.result_rows[0][0] != expected:
            raise RuntimeError(f"otel_traces holds {written.result_rows[0][0]} rows, expected {expected}")
    exporter_rate, raw_rate = statistics.median(runs["exporter"]), statistics.median(runs["raw"])
    ceiling = f"raw columnar client.insert, same rows, {BATCH_ROWS:,}-row inserts"
    return [
        Figure(
            f"BatchSpanProcessor + ClickHouseSpanExporter, {n:,} spans, median of {rounds}",
            exporter_rate,
            "spans/s",
            ceiling,
            raw_rate,
        ),
        Figure(
            "raw columnar client.insert at the SDK's 512-span batches",
            statistics.median(runs["raw512"]),
            "spans/s",
            ceiling,
            raw_rate,
        ),
    ]
