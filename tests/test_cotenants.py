"""A co-tenant's burst on a shared GPU, named by ``explain`` for a deviating decode that ran beside it.

The store is filled through the public writers: spans through the OTel SDK into ``ClickHouseSpanExporter`` (start
and end times chosen on the scrape grid), the gpu collector's tenant series as ``rows.node_metric_rows`` makes them from its own
``MetricSpec``s, on a regular grid of scrapes. Five requests with one input ran decode on the same GPU at different
times; one deviates. The class of case is a co-tenant whose use rose at the scrape that covers the deviating
request's decode and nowhere else near it: under time-slicing (SM utilization), under MPS (device memory; NVML
samples only the MPS server's utilization, whose work is every client's), and a co-tenant that arrived with its
burst. The cases where no co-tenant is to blame: one steady at a high level, a burst minutes before, the request's
own pod busier, the MPS server's utilization rising with everyone's work.
"""

from __future__ import annotations

import random
import re
import statistics
import time

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from stagetrace import conventions as st
from stagetrace import lookup
from stagetrace.analysis import activity, divergences
from stagetrace.analysis.explain import Explainer
from stagetrace.analysis.tenants import GIB, amount, describe
from stagetrace.collectors.base import Samples
from stagetrace.collectors.gpm import GPM_METRICS
from stagetrace.collectors.gpu_tenants import (
    MPS_SERVER,
    PROCESS,
    TENANT_MEMORY,
    TENANT_MEMORY_COPY,
    TENANT_MPS_CLIENTS,
    TENANT_PROCESSES,
    TENANT_SM,
)
from stagetrace.exporters.clickhouse import METRIC_COLUMNS, ClickHouseSpanExporter
from stagetrace.exporters.rows import node_metric_rows
from stagetrace.render import Output, evidence, gpu_activity
from stagetrace.report import incident_html

S = 1_000_000_000
INTERVAL = 15 * S
SCRAPES = 41
T0 = (time.time_ns() // INTERVAL) * INTERVAL - 3600 * S
HOST, UUID = "gpu-node", "GPU-5d2c8e1a-93b4-4c6f-a1e7-2f0b6d9c4e83"
GPU_LABELS = {"gpu": "0", "uuid": UUID, "model": "NVIDIA H200"}
OWN, OTHER, NO_POD = ("serve", "vllm-0"), ("batch", "worker-0"), ("", "")
ODD_AT = 20  # the deviating request's decode runs inside the interval after this scrape...
BURST = ODD_AT + 1  # ...which the next scrape's utilization covers
AGREEING_AT = (4, 8, 30, 34)


def at(i: int) -> int:
    return T0 + i * INTERVAL


def request(store, request_id: str, interval: int, output: str, pod: tuple[str, str] | None = OWN) -> None:
    """One request whose decode ran on the shared GPU from 2 s to 10 s after scrape ``interval``."""
    resource = {"service.name": "chat", "host.name": HOST}
    if pod is not None:
        resource |= {"k8s.namespace.name": pod[0], "k8s.pod.name": pod[1]}
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create(resource))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("app")
    start = at(interval) + 2 * S
    root = tracer.start_span(
        "inference.request",
        start_time=start,
        attributes={st.REQUEST_ID: request_id, st.INPUT_DIGEST: "in-1", st.OUTPUT_DIGEST: output},
    )
    decode = tracer.start_span(
        "decode",
        context=trace.set_span_in_context(root),
        start_time=start,
        attributes={
            st.STAGE: "decode",
            st.GPU_UUID: UUID,
            st.STAGE_INPUT_DIGEST: "ctx-1",
            st.STAGE_OUTPUT_DIGEST: output,
        },
    )
    decode.end(end_time=start + 8 * S)
    root.end(end_time=start + 8 * S)
    writer = ClickHouseSpanExporter(store=store, spool_dir=False, create_schema=False)
    assert writer.export(exporter.get_finished_spans()).name == "SUCCESS"
    provider.shutdown()


def scrapes(
    store, tenants: dict[tuple[str, str], dict], mps_server: tuple[str, str] | None = None, gpm: dict | None = None
) -> None:
    """The gpu collector's tenant series at every scrape. ``tenants`` maps a pod to {spec: {scrape: value}}; a pod
    is on the GPU at the scrapes its memory has a value for. ``gpm``: the whole GPU's GPM series, {spec: values}."""
    for i in range(SCRAPES):
        out = Samples()
        for spec, values in (gpm or {}).items():
            out.add(spec, values[i], **GPU_LABELS, gpu_instance="")
        for (namespace, pod), series in tenants.items():
            if i not in series[TENANT_MEMORY]:
                continue
            labels = {**GPU_LABELS, "namespace": namespace, "pod": pod}
            out.add(TENANT_PROCESSES, 1, **labels)
            out.add(TENANT_MPS_CLIENTS, 0 if (namespace, pod) == mps_server or mps_server is None else 1, **labels)
            for spec, values in series.items():
                if i in values:
                    out.add(spec, values[i], **labels)
        if mps_server is not None:
            out.add(
                PROCESS,
                {"namespace": mps_server[0], "pod": mps_server[1], "container": "", "role": MPS_SERVER},
                **GPU_LABELS,
                pid="4242",
            )
        rows = node_metric_rows([out], HOST, at(i))["otel_metrics_gauge"]
        store.client.insert("otel_metrics_gauge", rows, column_names=METRIC_COLUMNS, database=store.database)


def level(value: float, jitter: float, seed: int, only=None) -> dict[int, float]:
    """``value`` ± ``jitter`` at every scrape (or at the scrapes in ``only``), never below 0."""
    rng = random.Random(seed)
    return {i: max(0.0, value + rng.uniform(-jitter, jitter)) for i in range(SCRAPES) if only is None or i in only}


def burst(usual: float, peak: float, jitter: float, seed: int, at_scrapes=(BURST,), present=None) -> dict[int, float]:
    values = level(usual, jitter, seed, present)
    return {**values, **{i: peak + random.Random(seed + i).uniform(-jitter, jitter) for i in at_scrapes}}


def time_sliced(other_sm: dict, own_sm: dict | None = None) -> dict:
    """Two pods, each its own processes, NVML sampling each process's SM use."""
    return {
        OWN: {
            TENANT_MEMORY: level(30 * GIB, 0.1 * GIB, 1),
            TENANT_SM: own_sm or level(0.3, 0.05, 2),
            TENANT_MEMORY_COPY: level(0.2, 0.05, 3),
        },
        OTHER: {
            TENANT_MEMORY: level(8 * GIB, 0.1 * GIB, 4),
            TENANT_SM: other_sm,
            TENANT_MEMORY_COPY: level(0.05, 0.02, 5),
        },
    }


def mps_shared(other_memory: dict, server_sm: dict | None = None) -> dict:
    """Two pods as MPS clients (no SM share of their own) and the MPS server, in no pod, whose SM use is theirs."""
    return {
        OWN: {TENANT_MEMORY: level(30 * GIB, 0.1 * GIB, 1)},
        OTHER: {TENANT_MEMORY: other_memory},
        NO_POD: {TENANT_MEMORY: level(0.5 * GIB, 0.0, 6), TENANT_SM: server_sm or level(0.5, 0.1, 7)},
    }


def population(store, pod: tuple[str, str] | None = OWN) -> None:
    for n, interval in enumerate(AGREEING_AT):
        request(store, f"ok-{n}", interval, "out-1", pod)
    request(store, "odd", ODD_AT, "out-2", pod)


POSITIVE = {
    "sm-5%-to-80%": (time_sliced(burst(0.05, 0.8, 0.02, 10)), None, TENANT_SM, "time-slicing"),
    "sm-idle-to-40%": (time_sliced(burst(0.0, 0.4, 0.0, 11)), None, TENANT_SM, "time-slicing"),
    "memory-under-mps": (
        mps_shared(burst(4 * GIB, 40 * GIB, 0.2 * GIB, 12), burst(0.5, 0.95, 0.05, 13)),
        NO_POD,
        TENANT_MEMORY,
        "MPS",
    ),
    "arrived-under-mps": (
        mps_shared(burst(0, 12 * GIB, 0.0, 14, at_scrapes=(BURST, BURST + 1), present={BURST, BURST + 1})),
        NO_POD,
        TENANT_MEMORY,
        "MPS",
    ),
}


@pytest.mark.parametrize("case", POSITIVE, ids=list(POSITIVE))
def test_a_co_tenants_burst_during_the_decode_is_named(store, case):
    tenants, server, spec, sharing = POSITIVE[case]
    scrapes(store, tenants, server)
    population(store)
    report = Explainer(store).explain("odd").to_json()
    assert report["first_divergent_stage"] == "decode"
    top = report["causes"][0]
    assert (top["kind"], top["name"], top["tenant"], top["device"], top["sharing"], top["weak"]) == (
        "hardware",
        spec.name,
        "batch/worker-0",
        UUID,
        sharing,
        False,
    )
    # its usual level: the median over the scrapes up to the decode's (absent: 0); its peak: the scrape after
    written = tenants[OTHER][spec]
    usual, peak = statistics.median(written.get(i, 0.0) for i in range(ODD_AT + 1)), written[BURST]
    assert (top["before"], top["during"]) == (pytest.approx(usual), pytest.approx(peak))
    assert report["summary"].startswith(
        f"decode diverged: its GPU {UUID} ({HOST}) is shared by {sharing} with batch/worker-0, whose "
        f"{'SM utilization' if spec is TENANT_SM else 'device memory'} rose from {amount(usual, spec)} to "
        f"{amount(peak, spec)} while it ran, not for the baseline (baseline: request ok-"
    )
    assert all(c.get("tenant") != "serve/vllm-0" for c in report["causes"]), (
        "the request's own pod is never a co-tenant"
    )
    assert describe(top["name"], top) in evidence(top)
    if sharing == "MPS":  # the MPS server's SM use is every client's: not a tenant's own
        assert all(c["name"] != TENANT_SM.name for c in report["causes"])


NEGATIVE = {
    "steady-at-80%": (time_sliced(level(0.8, 0.05, 20)), None),
    "burst-minutes-before": (time_sliced(burst(0.05, 0.9, 0.02, 21, at_scrapes=range(10, 13))), None),
    "own-pod-busier": (time_sliced(level(0.05, 0.02, 22), own_sm=burst(0.3, 0.95, 0.05, 23)), None),
    "mps-server-busier": (mps_shared(level(8 * GIB, 0.2 * GIB, 24), server_sm=burst(0.4, 0.95, 0.05, 25)), NO_POD),
    "memory-copy-jitter": (
        time_sliced(level(0.05, 0.02, 26))
        | {
            OTHER: {
                TENANT_MEMORY: level(8 * GIB, 0.5 * GIB, 27),
                TENANT_SM: level(0.05, 0.02, 28),
                TENANT_MEMORY_COPY: level(0.1, 0.08, 29),
            }
        },
        None,
    ),
}


@pytest.mark.parametrize("case", NEGATIVE, ids=list(NEGATIVE))
def test_no_co_tenant_is_named_without_a_burst_of_its_own_while_the_decode_ran(store, case):
    tenants, server = NEGATIVE[case]
    scrapes(store, tenants, server)
    population(store)
    report = Explainer(store).explain("odd").to_json()
    assert report["first_divergent_stage"] == "decode"
    assert [c for c in report["causes"] if c.get("tenant")] == []
    assert "worker-0" not in report["summary"] and "shared by" not in report["summary"]


EVERY_CASE = {**{name: (tenants, server) for name, (tenants, server, _, _) in POSITIVE.items()}, **NEGATIVE}


@pytest.mark.parametrize("case", EVERY_CASE, ids=list(EVERY_CASE))
def test_divergences_reads_the_tenants_once_for_its_pass_and_names_what_explain_names(store, case):
    """``divergences`` (and so the live analyser) reads the GPUs' tenants once for every request it analyses; the
    verdict for each request is the one ``explain`` reaches reading that request's alone."""
    tenants, server = EVERY_CASE[case]
    scrapes(store, tenants, server)
    population(store)
    report = Explainer(store).explain("odd").to_json()
    found = divergences.find(store, 2 * 3600 * S, limit=None)
    [item] = [item for group in found["groups"] for item in group["deviating"]]
    assert (item["request_id"], item["first_divergent_stage"]) == ("odd", report["first_divergent_stage"])
    expected = next((c for c in report["causes"] if not c["weak"]), None)
    assert (item["top_cause"] or {}).get("name") == (expected or {}).get("name")
    assert (item["top_cause"] or {}).get("tenant") == (expected or {}).get("tenant")
    assert item["summary"] == report["summary"]


def test_a_span_that_names_no_pod_gets_a_co_tenants_burst_as_weak_evidence_only(store):
    """Without k8s.pod.name the request's own pod is unknown: the tenant that rose may be the request itself."""
    scrapes(store, time_sliced(burst(0.05, 0.8, 0.02, 30)))
    population(store, pod=None)
    report = Explainer(store).explain("odd").to_json()
    named = [c for c in report["causes"] if c.get("tenant")]
    assert named and all(c["weak"] and c["own_pod"].startswith("unknown") for c in named)
    assert "batch/worker-0" in {c["tenant"] for c in named}
    assert "shared by" not in report["summary"]


def test_trace_and_the_incident_report_show_the_gpus_activity_and_the_co_tenants_use(store, capsys):
    """Beside the stage: its GPU's SM, tensor and DRAM activity over the scrapes that cover it; in the report, the
    co-tenant's series and the GPU's activity around the stage's window."""
    specs = {m.spec.name: m.spec for m in GPM_METRICS}
    gpm = {specs[name]: burst(0.3, 0.9, 0.05, 40 + n) for n, name in enumerate(activity.SHOWN.values())}
    scrapes(store, time_sliced(burst(0.05, 0.8, 0.02, 41)), gpm=gpm)
    population(store)
    [row] = activity.of_trace(store, lookup.by_request_id(store, "odd"))
    assert (row["stage"], row["device"], row["host"]) == ("decode", UUID, HOST)
    for column, name in activity.SHOWN.items():  # the decode ran inside one interval: the scrape after it
        assert row[column] == pytest.approx(gpm[specs[name]][BURST])
    gpu_activity(Output(), [row])
    shown = capsys.readouterr().out
    assert "GPU activity while it ran" in shown and f"{row['tensor_active']:.0%}" in shown

    page = incident_html(store, Explainer(store).explain("odd"))
    figures = re.findall(r"<figcaption>(.*?)</figcaption>", page)
    assert any(TENANT_SM.name in f and "batch/worker-0" in f for f in figures), figures
    assert {name for name in activity.SHOWN.values() if any(name in f and "GPM" in f for f in figures)} == set(
        activity.SHOWN.values()
    )
