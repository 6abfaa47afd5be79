"""Spans that the OpenTelemetry Collector inserts itself, on each generation of its tables, are read by stagetrace.

A fleet shipping through the Collector never runs stagetrace's exporter: its spans reach ``otel_traces`` through the
Collector's ``clickhouseexporter``, and stagetrace sees them only through the materialized views it adds beside the
Collector's tables. ``tests/test_collector_generations.py`` writes spans with stagetrace's own writer; here they go
through a plain ``INSERT`` as the Collector sends them.

What is real and what is recorded:
- recorded: the Collector's DDL of each generation (``tests/fixtures/collector/{current,previous}.sql``, its
  rendered templates, loaded with ``test_collector_generations.adopted`` as the other generation tests do), and the
  shape of its insert, taken from the exporter (``internal/sqltemplates/traces_insert.sql`` and ``pushTraceData`` in
  opentelemetry-collector-contrib's ``exporter/clickhouseexporter``): the 22 columns in that order, TraceId and
  SpanId as lowercase hex, ``SpanKind`` and ``StatusCode`` as pdata's ``String()`` (``Server``, ``Internal``,
  ``Unset``), ``ServiceName`` from the resource's ``service.name``, the resource's attributes as they are, the scope in
  ``ScopeName``/``ScopeVersion``, ``Duration`` as end minus start in nanoseconds, ``Timestamp`` the span's start,
  empty ``Events.*``/``Links.*`` arrays; one ``INSERT`` per exported batch (clickhouse-go sends a prepared
  statement's rows as one block at commit), with ``async_insert = 1`` as the exporter has defaulted since PR #33614
  (2024-06, before either layout here) and the server's default ``wait_for_async_insert = 1``.
- real: the ClickHouse engine (chdb), the Collector's tables created from that DDL, stagetrace's schema ensured on
  top of them, its views firing on the Collector's inserts, and the public reads (``lookup``, ``stagetrace trace``,
  ``Explainer.explain``, ``divergences.find``).

The batches are cut as a Collector receives them from an SDK's batch processor: spans leave in the order they end,
so a request's stage spans come in one batch and its root span (which ends last) may come in the next; one deviating
request's root arrives in a batch of its own after its stages.
"""

from __future__ import annotations

import importlib.util
import json
import secrets
import time
from pathlib import Path

import pytest

from stagetrace import conventions as cv
from stagetrace import lookup
from stagetrace.analysis import divergences
from stagetrace.analysis.explain import Explainer
from stagetrace.digest import digest


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generations = _load("test_collector_generations")

# The exporter's insert column list (traces_insert.sql), in its order.
COLLECTOR_COLUMNS = (
    "Timestamp",
    "TraceId",
    "SpanId",
    "ParentSpanId",
    "TraceState",
    "SpanName",
    "SpanKind",
    "ServiceName",
    "ResourceAttributes",
    "ScopeName",
    "ScopeVersion",
    "SpanAttributes",
    "Duration",
    "StatusCode",
    "StatusMessage",
    "Events.Timestamp",
    "Events.Name",
    "Events.Attributes",
    "Links.TraceId",
    "Links.SpanId",
    "Links.TraceState",
    "Links.Attributes",
)
RESOURCE = {
    "service.name": "rag",
    "host.name": "node-a",
    "telemetry.sdk.language": "python",
    "telemetry.sdk.name": "opentelemetry",
    "telemetry.sdk.version": "1.27.0",
}
SCOPE = ("stagetrace", "0.1.0")
PROMPT = {"prompt": "why is the sky blue?", "seed": 7}
DEVIATING_STAGE = "context_assembly"
AGREEING = 4
MS = 1_000_000


def _text(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _map(attributes: dict[str, str]) -> str:
    return "{" + ", ".join(f"{_text(k)}: {_text(v)}" for k, v in attributes.items()) + "}"


def _row(span: dict) -> str:
    """One row of the Collector's VALUES: its 22 columns, in its order."""
    values = (
        f"fromUnixTimestamp64Nano(toInt64({span['start_ns']}))",
        _text(span["trace_id"]),
        _text(span["span_id"]),
        _text(span["parent_span_id"]),
        "''",
        _text(span["name"]),
        _text(span["kind"]),
        _text(RESOURCE["service.name"]),
        _map(RESOURCE),
        _text(SCOPE[0]),
        _text(SCOPE[1]),
        _map(span["attributes"]),
        str(span["duration_ns"]),
        "'Unset'",
        "''",
        "[]",
        "[]",
        "[]",
        "[]",
        "[]",
        "[]",
        "[]",
    )
    return "(" + ", ".join(values) + ")"


def collector_insert(store, batch: list[dict]) -> None:
    """One exported batch, as the Collector's clickhouseexporter inserts it."""
    store.client.command(
        f"INSERT INTO {store.database}.otel_traces ({', '.join(COLLECTOR_COLUMNS)}) "
        "SETTINGS async_insert = 1, wait_for_async_insert = 1 VALUES " + ", ".join(_row(s) for s in batch)
    )


def pipeline_spans(request_id: str, start_ns: int, deviate: bool = False) -> tuple[list[dict], dict]:
    """A request's stage spans and its root span, per stagetrace's conventions: the root carries the request ID and
    the input and output digests, each stage its name and its input and output digests (a stage's input is the
    previous stage's output). A deviating request's ``DEVIATING_STAGE`` makes another output from the same input,
    with another prompt template, and every stage after it follows."""
    trace_id, root_id = secrets.token_hex(16), secrets.token_hex(8)
    data, stages, t = PROMPT["prompt"], [], start_ns + MS
    for name in cv.PIPELINE_STAGES:
        out = f"{name}({data})" + ("*" if deviate and name == DEVIATING_STAGE else "")
        attributes = {cv.STAGE: name, cv.STAGE_INPUT_DIGEST: digest(data), cv.STAGE_OUTPUT_DIGEST: digest(out)}
        if name == DEVIATING_STAGE:
            attributes["prompt.template"] = "v2" if deviate else "v1"
        if name == "decode":
            attributes[cv.GPU_UUID] = "GPU-a"
        stages.append(
            {
                "trace_id": trace_id,
                "span_id": secrets.token_hex(8),
                "parent_span_id": root_id,
                "name": f"stage.{name}",
                "kind": "Internal",
                "start_ns": t,
                "duration_ns": 5 * MS,
                "attributes": attributes,
            }
        )
        data, t = out, t + 6 * MS
    root = {
        "trace_id": trace_id,
        "span_id": root_id,
        "parent_span_id": "",
        "name": "inference.request",
        "kind": "Server",
        "start_ns": start_ns,
        "duration_ns": t - start_ns + MS,
        "attributes": {cv.REQUEST_ID: request_id, cv.INPUT_DIGEST: digest(PROMPT), cv.OUTPUT_DIGEST: digest(data)},
    }
    return stages, root


@pytest.fixture(params=generations.GENERATIONS)
def collector_written(request, store_dsn):
    """(store, generation, {request ID: (stage spans, root span)}): stagetrace's schema on the Collector's tables of
    one generation, and a small pipeline's spans inserted as the Collector inserts them."""
    with generations.adopted(store_dsn, request.param) as store:
        base = time.time_ns() - 120 * 10**9
        requests = {f"ok-{i}": pipeline_spans(f"ok-{i}", base + i * 10**9) for i in range(AGREEING)}
        requests["odd"] = pipeline_spans("odd", base + AGREEING * 10**9, deviate=True)
        # the agreeing requests' spans in one batch, as they ended (each one's stages, then its root)
        collector_insert(store, [s for stages, root in list(requests.values())[:-1] for s in (*stages, root)])
        odd_stages, odd_root = requests["odd"]
        collector_insert(store, odd_stages)
        collector_insert(store, [odd_root])
        yield store, request.param, requests


def test_the_collectors_own_inserts_land_in_each_generations_tables(collector_written):
    store, generation, requests = collector_written
    want = "DateTime" if generation == "current" else "DateTime64(9)"
    assert generations.column_type(store, "otel_metrics_sum", "TimeUnix") == want  # the generation's own tables
    spans = sum(len(stages) + 1 for stages, _ in requests.values())
    assert store.client.command(f"SELECT count() FROM {store.database}.otel_traces") == spans


def test_trace_finds_each_request_with_all_its_stages(collector_written):
    """The lookup by request ID, through the Collector's trace-ID table of that generation, finds every span."""
    store, _, requests = collector_written
    for request_id, (stages, root) in requests.items():
        trace = lookup.by_request_id(store, request_id)
        assert (trace.request_id, trace.trace_id) == (request_id, root["trace_id"])
        assert sorted(s.span_id for s in trace.spans) == sorted([root["span_id"], *(s["span_id"] for s in stages)])
        assert [key[0] for key in trace.stages] == list(cv.PIPELINE_STAGES)
        assert (trace.input_digest, trace.output_digest) == (
            root["attributes"][cv.INPUT_DIGEST],
            root["attributes"][cv.OUTPUT_DIGEST],
        )
        assert trace.root.span_id == root["span_id"] and trace.start_ns == root["start_ns"]
        for stage in stages:
            (span,) = [s for s in trace.spans if s.span_id == stage["span_id"]]
            assert (span.stage, span.input_digest, span.output_digest, span.duration_ns) == (
                stage["attributes"][cv.STAGE],
                stage["attributes"][cv.STAGE_INPUT_DIGEST],
                stage["attributes"][cv.STAGE_OUTPUT_DIGEST],
                stage["duration_ns"],
            )
            assert (span.kind, span.service, span.resource["host.name"]) == ("Internal", "rag", "node-a")


def test_stagetrace_trace_cli_reads_the_collectors_spans(collector_written, store_dsn, capsys):
    """``stagetrace trace REQUEST_ID --json`` in this process, once the fixture's store is closed (chdb opens a
    path once per process)."""
    from stagetrace.cli import main

    store, _, requests = collector_written
    store.close()
    stages, root = requests["odd"]
    assert main(["trace", "odd", "--store", store_dsn, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["request_id"], doc["trace_id"], doc["service"]) == ("odd", root["trace_id"], "rag")
    assert [s["stage"] for s in doc["spans"]] == [None, *cv.PIPELINE_STAGES]
    assert [s["output_digest"] for s in doc["spans"][1:]] == [s["attributes"][cv.STAGE_OUTPUT_DIGEST] for s in stages]


def test_the_views_fill_the_request_index_and_stage_table(collector_written):
    """stagetrace's views fired on the Collector's inserts: one request row per root span, one stage row per stage
    span, with the digests and names the conventions derive."""
    store, _, requests = collector_written
    db = store.database
    rows = store.client.query(
        f"SELECT RequestId, TraceId, SpanId, InputDigest, OutputDigest, HostName, ServiceName, Source "
        f"FROM {db}.stagetrace_requests ORDER BY RequestId"
    ).result_rows
    assert rows == sorted(
        (
            rid,
            root["trace_id"],
            root["span_id"],
            root["attributes"][cv.INPUT_DIGEST],
            root["attributes"][cv.OUTPUT_DIGEST],
            "node-a",
            "rag",
            "attribute",
        )
        for rid, (_, root) in requests.items()
    )
    rows = store.client.query(
        f"SELECT SpanId, TraceId, ParentSpanId, Stage, InputDigest, OutputDigest, Duration, HostName "
        f"FROM {db}.stagetrace_stages ORDER BY SpanId"
    ).result_rows
    assert rows == sorted(
        (
            s["span_id"],
            s["trace_id"],
            s["parent_span_id"],
            s["attributes"][cv.STAGE],
            s["attributes"][cv.STAGE_INPUT_DIGEST],
            s["attributes"][cv.STAGE_OUTPUT_DIGEST],
            s["duration_ns"],
            "node-a",
        )
        for stages, _ in requests.values()
        for s in stages
    )
    trace_ids = store.client.query(
        f"SELECT TraceId FROM {db}.otel_traces_trace_id_ts GROUP BY TraceId ORDER BY TraceId"
    ).result_rows
    assert [r[0] for r in trace_ids] == sorted(root["trace_id"] for _, root in requests.values())


def test_explain_and_divergences_name_the_deviating_stage(collector_written):
    store, _, requests = collector_written
    report = Explainer(store).explain("odd").to_json()
    assert report["diverged"] and report["first_divergent_stage"] == DEVIATING_STAGE, report.get("summary")
    assert report["baseline"]["request_id"].startswith("ok-") and report["baseline"]["support"] == AGREEING
    names = [c["name"] for c in report["causes"]]
    assert names and names[0] == "prompt.template", report["summary"]
    found = divergences.find(store, 3600 * 10**9)
    (item,) = [i for g in found["groups"] for i in g["deviating"]]
    assert (item["request_id"], item["first_divergent_stage"]) == ("odd", DEVIATING_STAGE)
    (row,) = store.client.query(
        f"SELECT RequestId, FirstDivergentStage FROM {store.database}.stagetrace_divergences FINAL"
    ).result_rows
    assert row == ("odd", DEVIATING_STAGE)
