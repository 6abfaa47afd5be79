"""Trace lookup by request ID, for spans from the stage-span API and from the plain OpenTelemetry SDK."""

import io
import json
import subprocess
import sys
import time

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind, set_span_in_context

import stagetrace
from stagetrace import lookup
from stagetrace.cli import main
from stagetrace.exporters.clickhouse import ClickHouseSpanExporter
from stagetrace.store import open_store

# every span these tests store is also the corpus of the views' rows (tests/views_reference.py)
pytestmark = pytest.mark.views_row_for_row

STAGES = ["retrieval", "cache", "context_assembly", "allreduce", "decode"]
T0 = 1_764_000_000_000_000_000  # a fixed start, in ns


def _trace_json(capsys, *argv):
    assert main(["trace", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _write_with_plain_sdk(dsn, request_id):
    """Spans made with the bare SDK that follow the span conventions (docs/design.md#span-conventions); exact
    timestamps so durations are known."""
    exporter = ClickHouseSpanExporter(store=dsn)
    provider = TracerProvider(resource=Resource.create({"service.name": "plain-sdk", "host.name": "gpu-node-3"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("someone-elses-app")
    root = tracer.start_span(
        "llm",
        kind=SpanKind.SERVER,
        start_time=T0,
        attributes={
            "stagetrace.request.id": request_id,
            "stagetrace.input.digest": "in-root",
            "gen_ai.request.seed": 1,
        },
    )
    ctx = set_span_in_context(root)
    for i, name in enumerate(STAGES):
        start = T0 + (i * 10 + 1) * 1_000_000
        span = tracer.start_span(
            f"do-{name}",
            context=ctx,
            start_time=start,
            attributes={
                "stagetrace.stage": name,
                "stagetrace.stage.input_digest": f"in-{name}",
                "stagetrace.stage.output_digest": f"out-{name}",
            },
        )
        span.end(end_time=start + (i + 1) * 1_000_000)  # stage i lasts i+1 ms
    root.set_attribute("stagetrace.output.digest", "out-root")
    root.end(end_time=T0 + 60_000_000)
    provider.shutdown()


def test_plain_sdk_spans_are_looked_up_like_our_own(store_dsn, capsys):
    _write_with_plain_sdk(store_dsn, "plain-1")
    doc = _trace_json(capsys, "plain-1", "--store", store_dsn)
    assert doc["request_id"] == "plain-1" and doc["service"] == "plain-sdk"
    assert doc["duration_ms"] == 60.0 and doc["start"] == "2025-11-24T16:00:00.000000000Z"
    assert [s["stage"] for s in doc["spans"]] == [None, *STAGES]
    for i, span in enumerate(doc["spans"][1:]):
        assert span["duration_ms"] == i + 1
        assert span["attributes"]["stagetrace.stage.input_digest"] == f"in-{STAGES[i]}"
        assert span["attributes"]["stagetrace.stage.output_digest"] == f"out-{STAGES[i]}"
        assert span["parent_span_id"] == doc["spans"][0]["span_id"]
    assert doc["spans"][0]["attributes"]["stagetrace.output.digest"] == "out-root"
    by_trace = _trace_json(capsys, "--trace-id", doc["trace_id"], "--store", store_dsn)
    assert by_trace["request_id"] == "plain-1" and by_trace["spans"] == doc["spans"]


def test_stage_api_spans_come_back_in_order_with_their_digests(store_dsn, capsys):
    stagetrace.configure(service_name="api", store=store_dsn)
    prompt = {"prompt": "why is the sky blue?", "seed": 7, "model": "m"}
    with stagetrace.request("api-1", input=prompt) as req:
        for name in STAGES:
            with stagetrace.stage(name, input=f"{name}-in") as st:
                time.sleep(0.002)
                st.set_output(f"{name}-out")
        req.set_output("the answer")
    stagetrace.shutdown()
    doc = _trace_json(capsys, "api-1", "--store", store_dsn)
    root, *stages = doc["spans"]
    assert root["attributes"]["stagetrace.input.digest"] == stagetrace.digest(prompt)
    assert root["attributes"]["stagetrace.output.digest"] == stagetrace.digest("the answer")
    assert [s["stage"] for s in stages] == STAGES
    for name, span in zip(STAGES, stages):
        assert span["attributes"]["stagetrace.stage.input_digest"] == stagetrace.digest(f"{name}-in")
        assert span["attributes"]["stagetrace.stage.output_digest"] == stagetrace.digest(f"{name}-out")
        assert 2.0 <= span["duration_ms"] < root["duration_ms"]
    assert root["duration_ms"] >= sum(s["duration_ms"] for s in stages)
    assert [s["start"] for s in doc["spans"]] == sorted(s["start"] for s in doc["spans"])


@pytest.mark.views_row_for_row(compare=False)  # it empties stagetrace_requests
def test_lookup_goes_through_the_request_index(store_dsn):
    _write_with_plain_sdk(store_dsn, "indexed")
    with open_store(store_dsn) as store:
        assert lookup.by_request_id(store, "indexed").spans
        store.client.command("TRUNCATE TABLE stagetrace.stagetrace_requests")
        with pytest.raises(lookup.NotFound):  # the spans are still there, but lookups do not scan for them
            lookup.by_request_id(store, "indexed")


def test_vllm_request_id_alias_is_indexed(store_dsn):
    exporter = ClickHouseSpanExporter(store=store_dsn)
    provider = TracerProvider(resource=Resource.create({"service.name": "vllm"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.get_tracer("vllm").start_span("llm_request", attributes={"gen_ai.request.id": "cmpl-abc"}).end()
    provider.shutdown()
    with open_store(store_dsn) as store:
        assert lookup.by_request_id(store, "cmpl-abc").spans[0].name == "llm_request"


@pytest.mark.parametrize(
    "request_id", ["it's", 'q"uote', "a\\b", "x'; DROP TABLE stagetrace.otel_traces; --", "nul\0byte", "{rid:String}"]
)
def test_request_ids_with_quotes_or_sql_are_just_ids(store_dsn, request_id):
    _write_with_plain_sdk(store_dsn, request_id)
    with open_store(store_dsn) as store:
        assert lookup.by_request_id(store, request_id).request_id == request_id
        with pytest.raises(lookup.NotFound):
            lookup.by_request_id(store, request_id + "'")
        assert store.client.command("SELECT count() FROM stagetrace.otel_traces") == 6


def test_unknown_ids_exit_1_with_a_clear_message(store_dsn):
    _write_with_plain_sdk(store_dsn, "known")
    for argv in (["no-such-request"], ["--trace-id", "0" * 32], ["x' OR '1'='1"]):
        cli = subprocess.run(
            [sys.executable, "-m", "stagetrace", "trace", *argv, "--store", store_dsn],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 1, cli.stderr
        assert cli.stderr.startswith("stagetrace: no ") and "Traceback" not in cli.stderr
    assert (
        "no request with id 'no-such-request'"
        in subprocess.run(
            [sys.executable, "-m", "stagetrace", "trace", "no-such-request", "--store", store_dsn],
            capture_output=True,
            text=True,
            timeout=60,
        ).stderr
    )


def test_piped_waterfall_is_tab_separated_with_every_stage_in_order(store_dsn, capsys):
    _write_with_plain_sdk(store_dsn, "wf")
    assert main(["trace", "wf", "--store", store_dsn]) == 0  # captured: stdout is no terminal
    out = capsys.readouterr().out
    assert "request wf\n" in out and "─" not in out and "█" not in out  # no box drawing, no bars
    header, *rows = [line.split("\t") for line in out.splitlines() if "\t" in line]
    assert header[:3] == ["span", "start ms", "dur ms"] and all(len(row) == len(header) for row in rows)
    assert [row[0].strip() for row in rows if row[0].strip() in STAGES] == STAGES
    assert "in-ret→out-re" in out  # digests, shortened


def _granules(plan: str) -> list[tuple[str, int, int]]:
    """(what it reads, granules selected, granules in all) for each table read of an ``EXPLAIN indexes = 1`` plan."""
    import re

    out = []
    for block in plan.split("ReadFromMergeTree")[1:]:
        name = block.split("\n", 1)[0].strip()
        selected = re.search(r"Parts: \d+ \| Granules: (\d+)", block)
        totals = [int(n) for n in re.findall(r"Granules: \d+/(\d+)", block)]
        if selected and totals:
            out.append((name, int(selected.group(1)), max(totals)))
    return out


def test_every_lookup_query_reads_a_bounded_part_of_each_table(store, monkeypatch):
    """A store of 400,000 requests over ten hours (2.4 million spans, many granules in every table): each query a
    lookup by request ID or by trace ID runs, explained with its own parameters, reads a few granules of each table it
    touches, never all of them, so its cost does not grow with the store."""
    from benchmarks import synthetic

    synthetic.fill(store, 400_000, T0, seconds=10 * 3600)
    store.client.command("OPTIMIZE TABLE stagetrace.stagetrace_requests FINAL")
    ran: list[tuple[str, dict]] = []
    query = store.client.query

    def recorded(sql, parameters=None, **kwargs):
        ran.append((sql, parameters or {}))
        return query(sql, parameters=parameters, **kwargs)

    monkeypatch.setattr(store.client, "query", recorded)
    trace = lookup.by_request_id(store, "req-54321")
    assert trace.request_id == "req-54321" and len(trace.spans) == 6
    assert lookup.by_trace_id(store, trace.trace_id).request_id == "req-54321"
    monkeypatch.setattr(store.client, "query", query)
    assert len(ran) >= 5
    # the span reads cover the seconds the trace's spans started in, no margin: a window a minute wider would read
    # a minute of every stage's rows at a busy fleet's rate (granules here are too many for the bound below to see it)
    windows = [p["t1"] - p["t0"] for _, p in ran if "t0" in p]
    assert len(windows) == 2 and max(windows) <= 2 * 10**9, windows
    for sql, parameters in ran:
        if "FROM system.columns" in sql:  # the store's attribute layout, asked once (Store.readable): no table of it
            continue
        plan = "\n".join(
            row[0] for row in store.client.query(f"EXPLAIN indexes = 1 {sql}", parameters=parameters).result_rows
        )
        reads = _granules(plan)
        assert reads, plan
        for name, selected, total in reads:
            assert total >= 10 and selected <= total // 4, f"{name} reads {selected} of {total} granules for:\n{sql}"

    _dashboard_reads_are_bounded(store, trace)


def _dashboard_reads_are_bounded(store, trace):
    """Every query the Trace lookup and Compare dashboards send for a request, expanded as the data source does,
    runs on the same store under a row budget a whole-table read exceeds, scalar subqueries included (EXPLAIN does
    not show those): what Grafana runs for one request does not grow with the store either."""
    from datetime import datetime, timedelta, timezone

    from stagetrace.dashboards import build_all
    from tests.grafana_macros import QueryContext, Variable, expand

    now = datetime.now(timezone.utc)
    context = QueryContext(now - timedelta(hours=6), now, interval_ms=1000)  # the picker does not matter here
    variables = {"request_id": Variable(trace.request_id), "other_request_id": Variable("req-54322")}
    # a read of a few granules per table fits; a whole table (400,000 rows or more here) does not
    budget = {"max_rows_to_read": 200_000, "read_overflow_mode": "throw"}
    dashboards = build_all()
    store.client.database = store.database  # as the data source's default database
    ran, over = 0, []
    for uid in ("stagetrace-trace-lookup", "stagetrace-compare"):
        for panel in (p for row in dashboards[uid]["panels"] for p in [row, *row.get("panels", [])]):
            for target in panel.get("targets", []):
                sql = expand(target["rawSql"], context, variables)
                try:
                    store.client.query(sql, settings=budget)
                except Exception as exc:
                    over.append(f"{uid} / {panel['title']}: {str(exc).splitlines()[0]}")
                ran += 1
    assert ran >= 10 and not over, "\n".join(over)


MINUTE_NS = 60 * 1_000_000_000


def _span_on(dsn, host: str, name: str, start: int, end: int, parent=None, attributes=None, trace_root=False):
    """One span exported from ``host``'s own provider (its own clock): the root of a new trace, or a child of
    ``parent`` (a span context), with exact timestamps."""
    from opentelemetry.trace import NonRecordingSpan

    provider = TracerProvider(resource=Resource.create({"service.name": "rag", "host.name": host}))
    provider.add_span_processor(SimpleSpanProcessor(ClickHouseSpanExporter(store=dsn)))
    context = None if trace_root else set_span_in_context(NonRecordingSpan(parent))
    span = provider.get_tracer("t").start_span(
        name,
        context=context,
        start_time=start,
        attributes=attributes or {},
        kind=SpanKind.SERVER if trace_root else SpanKind.INTERNAL,
    )
    span.end(end_time=end)
    provider.shutdown()
    return span.get_span_context()


def _stage(dsn, host, stage, start, parent):
    return _span_on(
        dsn,
        host,
        f"stage.{stage}",
        start,
        start + 1_000_000,
        parent,
        {"stagetrace.stage": stage, "stagetrace.stage.input_digest": "i", "stagetrace.stage.output_digest": "o"},
    )


def test_spans_from_hosts_with_skewed_clocks_are_found_whole(store_dsn):
    """The root on a host with a good clock; the all-reduce rank spans from hosts whose clocks run four minutes
    behind and five ahead: a lookup by request ID and by trace ID returns all of them."""
    root = _span_on(
        store_dsn,
        "gpu-a",
        "request",
        T0,
        T0 + 2_000_000_000,
        trace_root=True,
        attributes={"stagetrace.request.id": "skewed"},
    )
    _stage(store_dsn, "gpu-a", "retrieval", T0 + 1_000_000, root)
    _stage(store_dsn, "gpu-behind", "allreduce", T0 - 4 * MINUTE_NS, root)
    _stage(store_dsn, "gpu-ahead", "allreduce", T0 + 5 * MINUTE_NS, root)
    with open_store(store_dsn) as store:
        for trace in (lookup.by_request_id(store, "skewed"), lookup.by_trace_id(store, format(root.trace_id, "032x"))):
            hosts = sorted(s.resource.get("host.name") for s in trace.spans)
            assert hosts == ["gpu-a", "gpu-a", "gpu-ahead", "gpu-behind"], hosts
            assert trace.request_id == "skewed"


def test_spans_that_arrive_minutes_late_are_found(store_dsn):
    """A request looked up, then two more of its spans stored minutes later: one inside its time, one that started
    three minutes after the root ended (a slow host's flush). The next lookup returns them all."""
    root = _span_on(
        store_dsn,
        "gpu-a",
        "request",
        T0,
        T0 + 1_000_000_000,
        trace_root=True,
        attributes={"stagetrace.request.id": "late"},
    )
    _stage(store_dsn, "gpu-a", "retrieval", T0 + 1_000_000, root)
    with open_store(store_dsn) as store:
        assert len(lookup.by_request_id(store, "late").spans) == 2
    _stage(store_dsn, "gpu-b", "decode", T0 + 500_000_000, root)
    _stage(store_dsn, "gpu-b", "allreduce", T0 + 4 * MINUTE_NS, root)
    with open_store(store_dsn) as store:
        stages = [s.stage for s in lookup.by_request_id(store, "late").spans]
        assert stages == [None, "retrieval", "decode", "allreduce"], stages


def test_a_retried_request_id_shows_its_latest_trace_whole(store_dsn):
    """The same request ID served twice, ten minutes apart, in two traces: the lookup shows the retry, with its own
    spans and none of the first attempt's."""
    first = _span_on(
        store_dsn, "gpu-a", "request", T0, T0 + 10**9, trace_root=True, attributes={"stagetrace.request.id": "retried"}
    )
    _stage(store_dsn, "gpu-a", "retrieval", T0 + 10**6, first)
    retry = _span_on(
        store_dsn,
        "gpu-b",
        "request",
        T0 + 10 * MINUTE_NS,
        T0 + 10 * MINUTE_NS + 10**9,
        trace_root=True,
        attributes={"stagetrace.request.id": "retried"},
    )
    for i, stage in enumerate(("retrieval", "decode")):
        _stage(store_dsn, "gpu-b", stage, T0 + 10 * MINUTE_NS + (i + 1) * 10**6, retry)
    with open_store(store_dsn) as store:
        trace = lookup.by_request_id(store, "retried")
    assert trace.trace_id == format(retry.trace_id, "032x")
    assert [s.stage for s in trace.spans] == [None, "retrieval", "decode"]
    assert {s.resource.get("host.name") for s in trace.spans} == {"gpu-b"}


def test_many_traces_are_read_whole_in_the_seconds_they_ran(store_dsn):
    """The analysis reads thousands of traces at once, spread over its window: `spans_of_many` reads each in the
    seconds the trace-ID table says it ran, traces near in time sharing a query, and with fewer queries allowed than
    clusters, the nearest merged. Each trace comes back whole (a rank on a host four minutes behind included), as a
    read of the whole window gives it, and no span of a trace not asked for."""
    roots = []
    for i, offset in enumerate((0, 2, 20 * MINUTE_NS, 20 * MINUTE_NS + 5, 50 * MINUTE_NS)):
        root = _span_on(
            store_dsn,
            "gpu-a",
            "request",
            T0 + offset,
            T0 + offset + 10**9,
            trace_root=True,
            attributes={"stagetrace.request.id": f"r{i}"},
        )
        _stage(store_dsn, "gpu-a", "retrieval", T0 + offset + 1_000_000, root)
        roots.append(format(root.trace_id, "032x"))
    skewed = _span_on(store_dsn, "gpu-a", "request", T0 + 30 * MINUTE_NS, T0 + 30 * MINUTE_NS + 10**9, trace_root=True)
    _stage(store_dsn, "gpu-behind", "allreduce", T0 + 26 * MINUTE_NS, skewed)
    _span_on(store_dsn, "gpu-a", "request", T0 + 3, T0 + 10**9, trace_root=True)  # a trace not asked for
    asked, window = roots + [format(skewed.trace_id, "032x")], (T0 - 3600 * 10**9, T0 + 3600 * 10**9)
    with open_store(store_dsn) as store:
        whole = lookup.spans_of(store, asked, *window)
        for windows in (lookup.MAX_WINDOWS, 2, 1):
            found = lookup.spans_of_many(store, asked, window, max_windows=windows)
            assert {t: [s.span_id for s in spans] for t, spans in found.items()} == {
                t: [s.span_id for s in spans] for t, spans in whole.items()
            } and len(found) == 6
            assert len(found[asked[-1]]) == 2
        assert lookup.spans_of_many(store, [], window) == {}


def _write_ties(dsn, request_id):
    """A request whose root and first stage start in the same nanosecond, and four TP ranks that start together,
    written in an order that is neither (ranks 3, 0, 2, 1; the stage before its root)."""
    exporter = ClickHouseSpanExporter(store=dsn)
    provider = TracerProvider(resource=Resource.create({"service.name": "ties", "host.name": "gpu-node-1"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("ties")
    root = tracer.start_span(
        "inference.request",
        kind=SpanKind.SERVER,
        start_time=T0,
        attributes={"stagetrace.request.id": request_id, "stagetrace.input.digest": "in"},
    )
    ctx = set_span_in_context(root)
    retrieval = tracer.start_span("retrieval", context=ctx, start_time=T0, attributes={"stagetrace.stage": "retrieval"})
    retrieval.end(end_time=T0 + 1_000_000)
    ranks = [
        tracer.start_span(
            "allreduce",
            context=ctx,
            start_time=T0 + 2_000_000,
            attributes={"stagetrace.stage": "allreduce", "parallel.tp_rank": rank},
        )
        for rank in (3, 0, 2, 1)
    ]
    for span in ranks:
        span.end(end_time=T0 + 3_000_000)
    root.set_attribute("stagetrace.output.digest", "out")
    root.end(end_time=T0 + 4_000_000)
    provider.shutdown()


def test_spans_whose_starts_tie_are_listed_parent_first_then_by_rank(store_dsn, capsys):
    """Ties broken the same way in every view: the JSON, the terminal's waterfall, the report's SVG (span IDs are
    random, so the order the SQL alone gave varied from request to request)."""
    from rich.console import Console

    from stagetrace.render import Output, waterfall
    from stagetrace.report import waterfall_svg

    expected = ["inference.request", "retrieval", "allreduce[0]", "allreduce[1]", "allreduce[2]", "allreduce[3]"]
    for n in range(4):
        _write_ties(store_dsn, f"ties-{n}")
        doc = _trace_json(capsys, f"ties-{n}", "--store", store_dsn)
        assert [
            (s["stage"] or s["name"]) + (f"[{s['rank']}]" if s.get("rank") else "") for s in doc["spans"]
        ] == expected
        with open_store(store_dsn) as store:
            trace = lookup.by_request_id(store, f"ties-{n}")
        console = Console(file=io.StringIO(), width=80, force_terminal=True, color_system=None, record=True)
        waterfall(Output(console), trace)
        rows = [line.split()[0] for line in console.export_text().splitlines() if "█" in line]  # the table's rows
        assert rows == expected
        svg = waterfall_svg(trace, None)
        labels = [label for label in expected if f">{label}</text>" in svg]
        assert sorted(labels, key=svg.index) == expected


def test_a_trace_id_given_as_a_request_id_is_named_with_the_option_that_finds_it(store_dsn):
    """A newcomer copies the ``trace`` line's ID into ``stagetrace trace``: not a request ID here (the request has
    one of its own), so the error names ``--trace-id`` with that ID, which then finds it."""
    _write_with_plain_sdk(store_dsn, "named")
    with open_store(store_dsn) as store:
        trace_id = lookup.by_request_id(store, "named").trace_id
    cli = subprocess.run(
        [sys.executable, "-m", "stagetrace", "trace", trace_id.upper(), "--store", store_dsn],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 1 and f"(it is a trace ID: stagetrace trace --trace-id {trace_id})" in cli.stderr, (
        cli.stderr
    )
    unknown = subprocess.run(
        [sys.executable, "-m", "stagetrace", "trace", "0" * 32, "--store", store_dsn],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unknown.returncode == 1 and "trace ID" not in unknown.stderr
