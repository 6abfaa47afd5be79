"""Which pod on which physical GPU served a request, and the co-tenant pods of an MPS-shared GPU as evidence.

The class of case: one GPU shared through MPS replicas by two pods (the recorded one-GPU node of
``tests/fixtures/kubelet``, served over the real PodResources protocol by a gRPC server on a unix socket and
read by the real ``kubernetes`` collector); a request decoded by one of the pods, whose spans carry the
OpenTelemetry Kubernetes resource attributes, exported with the plain SDK into a real embedded store.
"""

from __future__ import annotations

import time
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from stagetrace import conventions as st
from stagetrace import lookup
from stagetrace.analysis.detectors import Case
from stagetrace.analysis.detectors.hardware import HardwareSignals
from stagetrace.analysis.hardware import Samples
from stagetrace.analysis.pods import gpu_pods
from stagetrace.collectors import Options, build_node
from stagetrace.exporters.clickhouse import METRIC_COLUMNS, ClickHouseSpanExporter
from stagetrace.exporters.rows import node_metric_rows

SHARED = Path(__file__).parent / "fixtures" / "kubelet" / "one-gpu-mps"
GPU = "GPU-7e2b9d41-6a3c-4f18-8d05-b9c1e4a7f362"
S = 1_000_000_000


def scrape_kubelet(store, socket: Path, host: str, times: list[int]) -> None:
    node = build_node(["kubernetes"], Options(host=host, kubelet_socket=socket))
    try:
        for at in times:
            rows = node_metric_rows(node.collect(), host, at)
            if rows["otel_metrics_gauge"]:
                store.client.insert(
                    "otel_metrics_gauge",
                    rows["otel_metrics_gauge"],
                    column_names=METRIC_COLUMNS,
                    database=store.database,
                )
    finally:
        node.close()


def mps_clients(store, host: str, values: list[tuple[int, float]]) -> None:
    rows = [
        (
            {"host.name": host},
            "stagetrace-agent",
            "stagetrace.collectors",
            "",
            "mps_clients",
            "",
            "",
            {"uuid": GPU, "gpu": "0"},
            0,
            at,
            value,
        )
        for at, value in values
    ]
    store.client.insert("otel_metrics_gauge", rows, column_names=METRIC_COLUMNS, database=store.database)


def decode(store, request_id: str, pod: str, namespace: str, start: int) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(
        resource=Resource.create(
            {"service.name": "tts", "host.name": "gpu-a", "k8s.pod.name": pod, "k8s.namespace.name": namespace}
        )
    )
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("app")
    root = tracer.start_span("inference.request", start_time=start, attributes={st.REQUEST_ID: request_id})
    span = tracer.start_span(
        "decode",
        context=trace.set_span_in_context(root),
        start_time=start + S,
        attributes={st.STAGE: "decode", st.GPU_UUID: GPU},
    )
    span.end(end_time=start + 3 * S)
    root.end(end_time=start + 4 * S)
    writer = ClickHouseSpanExporter(store=store, spool_dir=False, create_schema=False)
    assert writer.export(exporter.get_finished_spans()).name == "SUCCESS"
    provider.shutdown()


def test_trace_names_the_pods_that_held_its_gpu_and_the_one_that_served_it(store, kubelet):
    start = (time.time_ns() // (15 * S)) * 15 * S - 600 * S
    scrape_kubelet(store, kubelet(SHARED), "gpu-a", [start - 60 * S, start + 15 * S])
    decode(store, "tts-42", "tts-0", "voice", start)
    found = lookup.by_request_id(store, "tts-42")
    assert gpu_pods(store, found) == [
        {"host": "gpu-a", "gpu": GPU, "held_by": ["batch/worker-0", "voice/tts-0"], "served_by": ["voice/tts-0"]}
    ]


def test_a_request_on_a_gpu_no_kubelet_reported_names_no_pods(store):
    decode(store, "tts-43", "tts-0", "voice", time.time_ns() - 600 * S)
    assert gpu_pods(store, lookup.by_request_id(store, "tts-43")) == []


def test_mps_co_tenancy_as_a_cause_names_the_pods_sharing_the_gpu(store, kubelet):
    """The hardware detector's mps_clients rise, for a request of voice/tts-0: the co-tenant is batch/worker-0."""
    start = (time.time_ns() // (15 * S)) * 15 * S - 600 * S
    scrape_kubelet(store, kubelet(SHARED), "gpu-a", [start - 60 * S, start])
    mps_clients(store, "gpu-a", [(start - 15 * S * i, 1.0) for i in range(1, 10)] + [(start + 15 * S, 2.0)])
    decode(store, "tts-44", "tts-0", "voice", start)
    request = lookup.by_request_id(store, "tts-44")
    (span,) = [s for s in request.spans if s.stage == "decode"]
    samples = Samples(store, ["gpu-a"], request.start_ns, request.start_ns + request.duration_ns)
    case = Case(store, request, request, "decode", {"": span}, {}, samples=samples)
    (cause,) = [c for c in HardwareSignals().detect(case) if c.name == "mps_clients"]
    assert cause.evidence["device"] == GPU and cause.evidence["co_tenants"] == ["batch/worker-0"]
