"""A store the OpenTelemetry Collector made with ``json: true`` (its JSON attribute layout) gives every answer the same
store made in its Map layout gives.

What is real and what is recorded:
- recorded: the Collector's DDL of its JSON layout (``tests/fixtures/collector_json/json.sql``, its templates rendered,
  with the release and files named in that folder's README) and of its Map layout
  (``tests/fixtures/collector/current.sql``), and the shape of the JSON exporter's insert
  (``exporter_traces_json.go`` ``pushTraceData`` and ``internal/sqltemplates/traces_json_insert.sql`` in
  opentelemetry-collector-contrib's ``exporter/clickhouseexporter``): its 22 columns, then ``ResourceAttributesKeys``
  and ``SpanAttributesKeys`` because the table has them; attributes as ``json.Marshal(attributes.AsRaw())``, so values
  keep their types (a number stays a number); one ``INSERT`` per exported batch with ``async_insert = 1``. The Map
  layout's insert is the Map exporter's (``tests/test_collector_inserts.py`` says where from), values as text.
- real: the ClickHouse engine (chdb), both stores made from that DDL, stagetrace's schema ensured on them, its views
  firing on the Collector's inserts, and the public reads (``lookup``, ``stagetrace trace``, ``Explainer.explain``,
  ``divergences.find``, the live analyser's pass).

Each store holds two services: ``rag`` with a request that deviates at context assembly (another prompt template),
and a neighbour, ``chat``, whose deviating request differs at decode on another GPU, in the same minute.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

import pytest

from stagetrace import conventions as cv
from stagetrace import lookup, schema
from stagetrace.analysis import divergences, live
from stagetrace.analysis.explain import Explainer
from stagetrace.digest import digest
from stagetrace.exporters.restore import Restorer
from stagetrace.store import open_store
from stagetrace.store_health import StoreHealth
from tests.test_collector_generations import collector_statements

# traces_json_insert.sql's columns in its order, the Keys columns appended as the exporter does when DESC shows them
JSON_COLUMNS = (
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
    "ResourceAttributesKeys",
    "SpanAttributesKeys",
)
SERVICES = {"rag": ("node-a", "GPU-a", "context_assembly"), "chat": ("node-b", "GPU-b", "decode")}
PROMPT = {"prompt": "why is the sky blue?", "seed": 7}
AGREEING = 4
MS = 1_000_000


def _text(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _resource(service: str) -> dict:
    return {"service.name": service, "host.name": SERVICES[service][0], "telemetry.sdk.language": "python"}


def _map(attributes: dict) -> str:
    """The Map exporter's attributes: every value as its text (pdata's ``AsString``)."""
    text = {k: ("true" if v is True else "false" if v is False else str(v)) for k, v in attributes.items()}
    return "{" + ", ".join(f"{_text(k)}: {_text(v)}" for k, v in text.items()) + "}"


def _row(span: dict, layout: str) -> str:
    """One row of the exporter's VALUES, in its column order: the JSON exporter sends attributes as JSON text, then
    the keys of each."""
    resource = _resource(span["service"])
    encode = (lambda a: _text(json.dumps(a))) if layout == "JSON" else _map
    values = [
        f"fromUnixTimestamp64Nano(toInt64({span['start_ns']}))",
        _text(span["trace_id"]),
        _text(span["span_id"]),
        _text(span["parent_span_id"]),
        "''",
        _text(span["name"]),
        _text(span["kind"]),
        _text(span["service"]),
        encode(resource),
        "'stagetrace'",
        "'0.1.0'",
        encode(span["attributes"]),
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
    ]
    if layout == "JSON":
        values += ["[" + ", ".join(_text(k) for k in keys) + "]" for keys in (resource, span["attributes"])]
    return "(" + ", ".join(values) + ")"


def collector_insert(store, layout: str, batch: list[dict]) -> None:
    """One exported batch, as the Collector's exporter of that layout inserts it."""
    columns = JSON_COLUMNS if layout == "JSON" else JSON_COLUMNS[:-2]
    store.client.command(
        f"INSERT INTO {store.database}.otel_traces ({', '.join(columns)}) "
        "SETTINGS async_insert = 1, wait_for_async_insert = 1 VALUES " + ", ".join(_row(s, layout) for s in batch)
    )


def pipeline(service: str, request_id: str, start_ns: int, deviate: bool = False) -> list[dict]:
    """A request's stage spans, then its root (the order they end in), with typed attributes where producers send
    them: a token count as a number, a cache hit as a boolean."""
    host, gpu, deviating = SERVICES[service]
    trace_id, root_id = secrets.token_hex(16), secrets.token_hex(8)
    data, spans, t = PROMPT["prompt"], [], start_ns + MS
    for name in cv.PIPELINE_STAGES:
        out = f"{name}({data})" + ("*" if deviate and name == deviating else "")
        attributes = {cv.STAGE: name, cv.STAGE_INPUT_DIGEST: digest(data), cv.STAGE_OUTPUT_DIGEST: digest(out)}
        if name == "context_assembly":
            attributes["prompt.template"] = "v2" if deviate and service == "rag" else "v1"
        if name == "cache":
            attributes["cache.hit"] = True
        if name == "decode":
            attributes |= {cv.GPU_UUID: gpu, "decode.tokens": 12, "gen_ai.request.temperature": 0}
        spans.append(
            {
                "service": service,
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
    spans.append(
        {
            "service": service,
            "trace_id": trace_id,
            "span_id": root_id,
            "parent_span_id": "",
            "name": "inference.request",
            "kind": "Server",
            "start_ns": start_ns,
            "duration_ns": t - start_ns + MS,
            "attributes": {cv.REQUEST_ID: request_id, cv.INPUT_DIGEST: digest(PROMPT), cv.OUTPUT_DIGEST: digest(data)},
        }
    )
    return spans


def batches() -> list[list[dict]]:
    """Both services' requests in one minute; each deviating request's spans in batches of their own."""
    base = time.time_ns() - 120 * 10**9
    agreeing, odd = [], []
    for s, service in enumerate(SERVICES):
        for i in range(AGREEING):
            agreeing += pipeline(service, f"{service}-ok-{i}", base + (2 * i + s) * 10**9)
        odd.append(pipeline(service, f"{service}-odd", base + (2 * AGREEING + s) * 10**9, deviate=True))
    return [agreeing, *[spans[:-1] for spans in odd], *[spans[-1:] for spans in odd]]


DATABASES = {"Map": "stagetrace", "JSON": "collector_json"}  # one embedded store a process: two databases in it


def _in(database: str, statement: str) -> str:
    return statement.replace('"stagetrace"', f'"{database}"').replace("`stagetrace`", f"`{database}`")


@pytest.fixture
def both_layouts(tmp_path):
    """{"Map": store, "JSON": store}: the Collector's tables of each attribute layout (two databases of one embedded
    store), adopted by stagetrace, holding the same spans as each of the Collector's exporters inserts them."""
    sent = batches()
    path = tmp_path / "store"
    with open_store(f"chdb://{path}", create_schema=False) as bare:
        for layout, statements in (("Map", collector_statements("current")), ("JSON", collector_statements("json"))):
            bare.client.command(f"CREATE DATABASE IF NOT EXISTS {DATABASES[layout]}")
            for statement in statements:
                bare.client.command(_in(DATABASES[layout], statement))
    stores = {layout: open_store(f"chdb://{path}?database={database}") for layout, database in DATABASES.items()}
    for layout, store in stores.items():
        for batch in sent:
            collector_insert(store, layout, batch)
    yield stores, sent
    for store in stores.values():
        store.close()


def test_schema_check_tells_the_json_layout_from_the_map_layout(both_layouts):
    stores, _ = both_layouts
    states = {layout: dict(schema.check(s.client, s.database)) for layout, s in stores.items()}
    json_tables = {"otel_traces", "otel_logs"}  # the metric tables stay on Maps with json: true (the fixture's README)
    for table in schema.COLLECTOR_TABLES:
        assert states["Map"][table] == schema.CURRENT
        want = f"{schema.CURRENT}, {schema.JSON_ATTRIBUTES}" if table in json_tables else schema.CURRENT
        assert states["JSON"][table] == want, table
    for layout in stores:
        assert "missing" not in states[layout].values()
        assert states[layout]["stagetrace_spans"] == states[layout]["stagetrace_stages_mv"] == "stagetrace's own view"


def test_the_views_write_the_same_rows_from_either_layout(both_layouts):
    stores, sent = both_layouts
    rows = {}
    for layout, store in stores.items():
        rows[layout] = [
            store.client.query(sql, parameters={"db": store.database}).result_rows
            for sql in (
                "SELECT RequestId, TraceId, SpanId, InputDigest, OutputDigest, HostName, ServiceName, Source, Model "
                "FROM {db:Identifier}.stagetrace_requests ORDER BY SpanId",
                "SELECT SpanId, Stage, InputDigest, OutputDigest, HostName, Attributes, ResourceAttributes "
                "FROM {db:Identifier}.stagetrace_stages ORDER BY SpanId",
                "SELECT TraceId, min(Start) FROM {db:Identifier}.otel_traces_trace_id_ts GROUP BY TraceId ORDER BY TraceId",
            )
        ]
    assert rows["JSON"] == rows["Map"]
    requests, stages, traces = rows["JSON"]
    spans = [s for batch in sent for s in batch]
    assert len(requests) == len(traces) == sum(1 for s in spans if not s["parent_span_id"])
    assert len(stages) == len(spans) - len(requests)
    decode = next(r for r in stages if r[1] == "decode")
    assert (decode[5]["decode.tokens"], decode[5][cv.GPU_UUID]) == ("12", "GPU-a" if decode[4] == "node-a" else "GPU-b")


def test_trace_finds_each_request_alike_on_either_layout(both_layouts):
    stores, sent = both_layouts
    roots = [s for batch in sent for s in batch if not s["parent_span_id"]]
    for root in roots:
        request_id = root["attributes"][cv.REQUEST_ID]
        found = {layout: lookup.by_request_id(store, request_id) for layout, store in stores.items()}
        trace = found["JSON"]
        assert (trace.request_id, trace.trace_id, trace.service) == (request_id, root["trace_id"], root["service"])
        assert [key[0] for key in trace.stages] == list(cv.PIPELINE_STAGES)
        assert [
            (s.span_id, s.stage, s.input_digest, s.output_digest, s.attributes, s.resource) for s in trace.spans
        ] == [
            (s.span_id, s.stage, s.input_digest, s.output_digest, s.attributes, s.resource) for s in found["Map"].spans
        ]
        cache = next(s for s in trace.spans if s.stage == "cache")
        assert cache.attributes["cache.hit"] == "true" and cache.resource["host.name"] == SERVICES[root["service"]][0]


def test_explain_divergences_and_live_analysis_agree_on_either_layout(both_layouts):
    stores, _ = both_layouts
    answers = {}
    for layout, store in stores.items():
        step = live.Analyser(
            store, live.Schedule(settle_s=0, lookback_s=7200)
        ).step()  # first: what it keeps is its own
        kept = store.client.query(
            "SELECT RequestId, FirstDivergentStage FROM {db:Identifier}.stagetrace_divergences "
            "FINAL ORDER BY RequestId",
            parameters={"db": store.database},
        ).result_rows
        reports = {rid: Explainer(store).explain(rid).to_json() for rid in ("rag-odd", "chat-odd")}
        found = divergences.find(store, 3600 * 10**9)
        answers[layout] = (
            {
                rid: (
                    r["diverged"],
                    r["first_divergent_stage"],
                    r["baseline"]["request_id"][:-1],
                    r["baseline"]["support"],
                    [(c["kind"], c["name"]) for c in r["causes"]],
                    r["summary"],
                )
                for rid, r in reports.items()
            },
            sorted((i["request_id"], i["first_divergent_stage"]) for g in found["groups"] for i in g["deviating"]),
            step.analysed,
            kept,
        )
    assert answers["JSON"] == answers["Map"]
    reports, deviating, analysed, kept = answers["JSON"]
    assert reports["rag-odd"][:2] == (True, "context_assembly") and reports["rag-odd"][4][0] == (
        "attribute",
        "prompt.template",
    )
    assert reports["chat-odd"][:2] == (True, "decode")
    assert reports["rag-odd"][2] == "rag-ok-" and reports["chat-odd"][2] == "chat-ok-"  # each its own service's peers
    assert deviating == [("chat-odd", "decode"), ("rag-odd", "context_assembly")]
    assert analysed == len(deviating) and kept == deviating  # the live pass found both, and only them


def test_stagetrace_trace_cli_reads_the_json_layout(both_layouts, capsys):
    from stagetrace.cli import main

    stores, sent = both_layouts
    dsn = f"chdb://{stores['JSON'].location.path}?database={DATABASES['JSON']}"
    for store in stores.values():
        store.close()
    assert main(["trace", "chat-odd", "--store", dsn, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["request_id"], doc["service"]) == ("chat-odd", "chat")
    assert [s["stage"] for s in doc["spans"]] == [None, *cv.PIPELINE_STAGES]


def test_a_request_is_found_within_a_second_of_its_spans_being_stored(both_layouts):
    """The views fill the request index as the Collector's insert stores the spans (the insert returns once they
    are stored, async_insert or not): a lookup right after finds the request whole, on either layout."""
    stores, _ = both_layouts
    spans = pipeline("chat", "chat-late", time.time_ns() - 5 * 10**9)
    for layout, store in stores.items():
        collector_insert(store, layout, spans)
        stored = time.monotonic()
        trace = lookup.by_request_id(store, "chat-late")
        assert time.monotonic() - stored < 1.0, layout
        assert sorted(s.span_id for s in trace.spans) == sorted(s["span_id"] for s in spans)


DERIVED_ROWS = {  # each table the views fill from otel_traces, as a reader sees it
    "stagetrace_requests": "SELECT * FROM {db:Identifier}.stagetrace_requests ORDER BY TraceId, SpanId",
    "stagetrace_stages": "SELECT * FROM {db:Identifier}.stagetrace_stages ORDER BY TraceId, SpanId",
    "otel_traces_trace_id_ts": "SELECT TraceId, min(Start), max(End) FROM {db:Identifier}.otel_traces_trace_id_ts "
    "GROUP BY TraceId ORDER BY TraceId",
}
_LARGEST_PART_SQL = """
SELECT name FROM system.parts WHERE database = {db:String} AND table = {table:String} AND active
ORDER BY rows DESC, name LIMIT 1"""
_DETACHED_PATH_SQL = """
SELECT path FROM system.detached_parts WHERE database = {db:String} AND table = {table:String} AND name = {name:String}"""


def _break_a_part(store, table: str) -> str:
    """Detach ``table``'s largest part and name it as the engine names a part it found broken (``broken_<part>``)."""
    where = {"db": store.database, "table": table}
    ((name,),) = store.client.query(_LARGEST_PART_SQL, parameters=where).result_rows
    store.client.command(f"ALTER TABLE {store.database}.`{table}` DETACH PART '{name}'")
    ((path,),) = store.client.query(_DETACHED_PATH_SQL, parameters=where | {"name": name}).result_rows
    path = Path(path)
    path.rename(path.with_name(f"broken_{name}"))
    return name


def test_a_broken_part_of_a_derived_table_is_rebuilt_alike_on_either_layout(both_layouts):
    """A part of each table the views fill, found broken (both services' rows in it): the restore makes its rows again
    from otel_traces by the views' own queries, reading the JSON layout as the views do. Each table then holds what
    the views wrote, each row once, on either layout. The damage is a part detached and renamed as the engine names a
    broken one (``tests/test_store_health.py`` truncates a part's file for real; the restore it starts is the same)."""
    stores, _ = both_layouts
    written, rebuilt = {}, {}
    for layout, store in stores.items():
        read = {
            t: store.client.query(sql, parameters={"db": store.database}).result_rows for t, sql in DERIVED_ROWS.items()
        }
        assert all(read.values()), layout
        written[layout] = read
        broken = {table: _break_a_part(store, table) for table in DERIVED_ROWS}
        restorer = Restorer(store, None)
        found = StoreHealth(store, restore=restorer).check()
        assert {(p.table, p.name) for p in found} == {(t, f"broken_{n}") for t, n in broken.items()}, layout
        assert not restorer.waiting, layout  # every rebuild succeeded: none left to retry
        rebuilt[layout] = {
            t: store.client.query(sql, parameters={"db": store.database}).result_rows for t, sql in DERIVED_ROWS.items()
        }
        for table in ("stagetrace_requests", "stagetrace_stages"):  # none twice
            keys = store.client.query(f"SELECT TraceId, SpanId FROM {store.database}.{table}").result_rows
            assert len(keys) == len(set(keys)), (layout, table)
    assert rebuilt["JSON"] == written["JSON"]
    assert rebuilt == written and written["JSON"] == written["Map"]
    services = {
        row[0]
        for row in stores["JSON"]
        .client.query("SELECT DISTINCT ServiceName FROM collector_json.stagetrace_requests")
        .result_rows
    }
    assert services == set(SERVICES)
