"""Dashboards as code: committed JSON, the issue's contract, and every query run on a store the demo filled.

The demo runs once for this module, as a separate ``stagetrace demo`` process; the store is then
opened here with the data source's ``defaultDatabase`` as the connection's database. Each query runs
after exactly the rewrites the ClickHouse data source applies (``tests.grafana_macros.expand``)
and must return the columns its panel type needs.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone

import pytest

from stagetrace import dashboards
from stagetrace.analysis.explain import Explainer
from stagetrace.dashboards import _panels, build_all, compare, render
from stagetrace.dashboards.__main__ import main as regenerate
from tests.grafana_macros import ALL, QueryContext, Variable, expand

DASHBOARDS = build_all()
NUMERIC = re.compile(r"^(Nullable\()?(U?Int\d+|Float\d+|Decimal.*)\)?$")
STRING = re.compile(r"^(Nullable\()?(LowCardinality\()?(Nullable\()?String\)*$")
TIME = re.compile(r"^(Nullable\()?DateTime(64)?(\(.*\))?\)?$")
# The Traces panel's required aliases (case-sensitive) and the type each must have.
TRACE_COLUMNS = {
    "traceID": STRING,
    "spanID": STRING,
    "parentSpanID": STRING,
    "serviceName": STRING,
    "operationName": STRING,
    "startTime": NUMERIC,
    "duration": NUMERIC,
    "tags": re.compile(r"^Array\(Map\(String, String\)\)$"),
    "serviceTags": re.compile(r"^Array\(Map\(String, String\)\)$"),
}
TRACE_OPTIONAL = {
    "kind",
    "statusCode",
    "statusMessage",
    "instrumentationLibraryName",
    "instrumentationLibraryVersion",
    "traceState",
    "logs",
    "references",
}
DEMO_HOSTS = re.compile(r"gpu-node-\d\d")


# ---------------------------------------------------------------------------------------------
# Committed JSON


def test_committed_json_is_what_the_builders_produce():
    for uid, dashboard in DASHBOARDS.items():
        committed = dashboards.GENERATED / f"{uid}.json"
        assert committed.exists(), f"{committed} is missing: run python -m stagetrace.dashboards"
        assert committed.read_text() == render(dashboard), f"{committed} is stale: run python -m stagetrace.dashboards"
    assert {p.stem for p in dashboards.GENERATED.glob("*.json")} == set(DASHBOARDS)


def test_regenerate_command_writes_the_files_and_check_finds_a_stale_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(dashboards, "GENERATED", tmp_path)
    assert regenerate([]) == 0
    assert sorted(p.stem for p in tmp_path.glob("*.json")) == sorted(DASHBOARDS)
    assert regenerate(["--check"]) == 0
    (tmp_path / "stagetrace-gpu.json").write_text("{}\n")
    (tmp_path / "left-over.json").write_text("{}\n")
    capsys.readouterr()
    assert regenerate(["--check"]) == 1
    err = capsys.readouterr().err
    assert "stagetrace-gpu.json differs" in err and "left-over.json has no builder" in err
    assert regenerate([]) == 0
    assert (tmp_path / "stagetrace-gpu.json").read_text() == render(DASHBOARDS["stagetrace-gpu"])
    assert not (tmp_path / "left-over.json").exists()


# ---------------------------------------------------------------------------------------------
# The shape the issue asks for


def _panels_of(dashboard: dict) -> list[dict]:
    return [panel for panel in dashboard["panels"] if panel["type"] != "row"]


def _variables(dashboard: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def test_the_eight_dashboards_and_their_variables():
    expected = {
        "stagetrace-overview": {"datasource", "service", "host"},
        "stagetrace-trace-lookup": {"datasource", "request_id"},
        "stagetrace-divergences": {"datasource", "service", "host"},
        "stagetrace-compare": {"datasource", "request_id", "other_request_id"},
        "stagetrace-gpu": {"datasource", "host", "gpu"},
        "stagetrace-rdma": {"datasource", "host", "nic"},
        "stagetrace-fabric": {"datasource", "host"},
        "stagetrace-weights": {"datasource", "service"},
    }
    assert set(DASHBOARDS) == set(expected)
    for uid, names in expected.items():
        variables = _variables(DASHBOARDS[uid])
        assert names <= set(variables), uid
        for name in names - {"datasource", "request_id", "other_request_id"}:
            assert variables[name]["type"] == "query" and variables[name]["multi"] and variables[name]["includeAll"]
            assert variables[name]["refresh"] == 2, f"{uid} ${name} must follow the time range"
    request_id = _variables(DASHBOARDS["stagetrace-trace-lookup"])["request_id"]
    assert request_id["type"] == "textbox"


def test_every_panel_has_a_unit_and_reads_the_selected_data_source():
    for uid, dashboard in DASHBOARDS.items():
        assert dashboard["schemaVersion"] == _panels.SCHEMA_VERSION and dashboard["tags"] == ["stagetrace"]
        ids = [panel["id"] for panel in dashboard["panels"]]
        assert len(ids) == len(set(ids)), uid
        for panel in _panels_of(dashboard):
            where = f"{uid} / {panel['title']}"
            assert panel["fieldConfig"]["defaults"].get("unit"), f"{where} has no unit"
            assert panel["description"], f"{where} has no description"
            assert panel["datasource"] == {"type": _panels.DATASOURCE_TYPE, "uid": "${datasource}"}, where
            assert 0 <= panel["gridPos"]["x"] and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, where
            for target in panel["targets"]:
                assert target["datasource"] == panel["datasource"] and target["editorType"] == "sql", where
                expected_format = {"timeseries": 0, "logs": 2, "traces": 3}.get(panel["type"], 1)
                assert target["format"] == expected_format, where


def test_trace_lookup_has_a_traces_panel_in_the_plugins_trace_format():
    (trace,) = [p for p in DASHBOARDS["stagetrace-trace-lookup"]["panels"] if p["type"] == "traces"]
    assert trace["targets"][0]["format"] == 3 and trace["targets"][0]["queryType"] == "traces"


def test_divergence_explorer_links_each_request_to_the_trace_lookup_dashboard():
    (table,) = [p for p in DASHBOARDS["stagetrace-divergences"]["panels"] if p["title"] == "Deviating requests"]
    links = {
        o["matcher"]["options"]: prop["value"]
        for o in table["fieldConfig"]["overrides"]
        for prop in o["properties"]
        if prop["id"] == "links"
    }
    assert set(links) == {"request_id", "baseline_request_id"}
    for field, (link, *_) in links.items():
        assert link["url"].startswith(f"/d/{_panels.TRACE_LOOKUP_UID}/")
        assert f"var-request_id=${{__data.fields.{field}:percentencode}}" in link["url"]
    (_, both) = links["request_id"]  # and the pair, side by side
    assert both["url"].startswith(f"/d/{compare.UID}/") and "var-request_id=${__data.fields.request_id" in both["url"]
    assert "var-other_request_id=${__data.fields.baseline_request_id:percentencode}" in both["url"]
    assert {_panels.TRACE_LOOKUP_UID, compare.UID} <= set(DASHBOARDS)


# ---------------------------------------------------------------------------------------------
# Every query, on the demo's data


def run(store, sql: str) -> tuple[list[str], list[str], list[list]]:
    """Column names, column types and rows (types even when there are no rows)."""
    result = json.loads(store.client.raw_query(sql, fmt="JSONCompact"))
    return [c["name"] for c in result["meta"]], [c["type"] for c in result["meta"]], result["data"]


@pytest.fixture(scope="module")
def window(demo_store) -> QueryContext:
    ((first, last),) = demo_store.client.query("SELECT min(Timestamp), max(Timestamp) FROM otel_traces").result_rows
    utc = timezone.utc
    return QueryContext(
        first.replace(tzinfo=utc) - timedelta(minutes=1),
        last.replace(tzinfo=utc) + timedelta(minutes=1),
        interval_ms=1000,
    )


@pytest.fixture(scope="module")
def demo_metrics(demo_store) -> set[str]:
    sql = "SELECT DISTINCT MetricName FROM otel_metrics_gauge UNION DISTINCT SELECT DISTINCT MetricName FROM otel_metrics_sum"
    return {row[0] for row in demo_store.client.query(sql).result_rows}


def truth_request(store, cause: str) -> str:
    sql = "SELECT RequestId FROM stagetrace_demo_truth WHERE Cause = {cause:String} ORDER BY RequestId LIMIT 1"
    return store.client.query(sql, parameters={"cause": cause}).result_rows[0][0]


def all_selected(request_id: str) -> dict[str, Variable]:
    """Every multi-value variable on All; the repeated stage panel gets one stage, as Grafana's repeat does."""
    multi = {name: Variable((ALL,)) for name in ("service", "host", "gpu", "nic")}
    return {
        **multi,
        "stage": Variable("decode"),
        "request_id": Variable(request_id),
        "other_request_id": Variable(request_id),
    }


def queries(dashboard: dict):
    """(what, kind, sql) of every query the dashboard sends: its query variables, then its panels."""
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            yield f"${variable['name']}", "variable", variable["query"]["rawSql"], variable
    for panel in _panels_of(dashboard):
        for target in panel["targets"]:
            yield panel["title"], panel["type"], target["rawSql"], panel


def column_problems(kind: str, names: list[str], types: list[str], item: dict) -> list[str]:
    """Why the result would not render in a panel of this kind (empty when it would)."""
    typed = dict(zip(names, types))
    problems = []
    if kind == "variable":
        if len(names) not in (1, 2) or not all(STRING.match(t) for t in types):
            problems.append(f"a query variable needs one or two string columns (value, text), got {typed}")
    elif kind == "timeseries":
        if not names or names[0] != "time" or not TIME.match(types[0]):
            problems.append(f"a time series needs a first column `time` of a DateTime type, got {typed}")
        if not any(NUMERIC.match(t) for t in types[1:]):
            problems.append(f"a time series needs a numeric column, got {typed}")
        if any(not (NUMERIC.match(t) or STRING.match(t)) for t in types[1:]):
            problems.append(f"time-series columns after `time` must be labels (strings) or values, got {typed}")
    elif kind == "stat":
        if not any(NUMERIC.match(t) for t in types):
            problems.append(f"a stat panel needs a numeric column, got {typed}")
    elif kind == "traces":
        for alias, pattern in TRACE_COLUMNS.items():
            if alias not in typed or not pattern.match(typed[alias]):
                problems.append(f"the Traces panel needs {alias} ({pattern.pattern}), got {typed.get(alias)}")
        problems += [
            f"unexpected Traces column {n}" for n in names if n not in TRACE_COLUMNS and n not in TRACE_OPTIONAL
        ]
    elif kind == "logs":  # the plugin's logs format: a time, a body, a level
        for column, pattern in (("timestamp", TIME), ("body", STRING), ("level", STRING)):
            if column not in typed or not pattern.match(typed[column]):
                problems.append(f"the Logs panel needs {column} ({pattern.pattern}), got {typed.get(column)}")
    elif kind == "table":
        if not names:
            problems.append("a table needs columns")
        fields = [o["matcher"]["options"] for o in item["fieldConfig"]["overrides"]]
        fields += [s["displayName"] for s in item["options"].get("sortBy", [])]
        problems += [
            f"an override or sort names column {f!r}, which the query does not return" for f in fields if f not in names
        ]
    return problems


def may_be_empty(sql: str, demo_metrics: set[str]) -> bool:
    """The demo writes no divergence analysis, no logs and no MPS, ethtool or NCCL samples: panels of those may be
    empty.

    A panel's metrics are those of its first MetricName condition (later ones filter, e.g. rdma_port_info).
    """
    plotted = re.search(r"MetricName (?:= '([a-z0-9_]+)'|IN \(([^)]*)\))", sql)
    names = set(re.findall(r"[a-z0-9_]+", plotted.group(1) or plotted.group(2))) if plotted else set()
    logs = (
        "otel_logs" in sql or "stagetrace_logs" in sql
    )  # the log table, or the view that reads it (schema.READ_VIEWS)
    return "stagetrace_divergences" in sql or logs or bool(names and not names & demo_metrics)


@pytest.mark.parametrize("uid", sorted(DASHBOARDS))
def test_every_query_runs_and_returns_what_its_panel_needs(uid, demo_store, window, demo_metrics):
    request_id = truth_request(demo_store, "gpu_xid_errors_total")
    failures = []
    for what, kind, sql, item in queries(DASHBOARDS[uid]):
        expanded = expand(sql, window, all_selected(request_id))
        try:
            names, types, rows = run(demo_store, expanded)
        except Exception as exc:  # the server's message says what is wrong with the SQL
            failures.append(f"{what}: {str(exc).splitlines()[0]}")
            continue
        failures += [f"{what}: {problem}" for problem in column_problems(kind, names, types, item)]
        if not rows and not may_be_empty(sql, demo_metrics):
            failures.append(f"{what}: no rows, although the demo wrote the data it reads")
        if kind == "timeseries" and [r[0] for r in rows] != sorted(r[0] for r in rows):
            failures.append(f"{what}: rows are not in time order")
    assert not failures, "\n".join(failures)


def test_selected_values_filter_every_panel(demo_store, window):
    """With one host, GPU and NIC selected, no row of any panel names another demo host."""
    host = "gpu-node-02"
    (gpu,) = demo_store.client.query(
        "SELECT any(Attributes['uuid']) FROM otel_metrics_gauge WHERE MetricName = 'gpu_up' "
        "AND ResourceAttributes['host.name'] = {host:String} AND Attributes['gpu'] = '0'",
        parameters={"host": host},
    ).result_rows[0]
    variables = {
        "service": Variable(("rag-demo",)),
        "host": Variable((host,)),
        "gpu": Variable((gpu,)),
        "nic": Variable(("mlx5_0",)),
        "stage": Variable("decode"),
    }
    checked = 0
    for uid in ("stagetrace-overview", "stagetrace-gpu", "stagetrace-rdma", "stagetrace-divergences"):
        for what, _, sql, _ in queries(DASHBOARDS[uid]):
            if what == "$host":  # the host variable lists every host to choose from
                continue
            _, _, rows = run(demo_store, expand(sql, window, variables))
            cells = " ".join(str(cell) for row in rows for cell in row)
            assert set(DEMO_HOSTS.findall(cells)) <= {host}, f"{uid} / {what} shows other hosts"
            if "gpu-node-02 GPU" in cells and what != "$gpu":  # the GPU variable lists the host's GPUs
                assert "gpu-node-02 GPU 1" not in cells, f"{uid} / {what} shows an unselected GPU"
            checked += bool(rows)
    assert checked > 20


@pytest.mark.parametrize("typed", ["x' OR 1=1 --", "x\\' OR 1=1 --", "x\\", "' UNION SELECT 1 --", "%27 OR 1=1"])
def test_a_typed_request_id_cannot_leave_its_string_literal(typed, demo_store, window):
    for what, kind, sql, item in queries(DASHBOARDS["stagetrace-trace-lookup"]):
        names, types, rows = run(demo_store, expand(sql, window, {"request_id": Variable(typed)}))
        assert rows == [], f"{what} found rows for request ID {typed!r}"


def test_trace_lookup_shows_the_request_its_stages_and_the_hardware_that_failed_it(demo_store, window):
    lookup = {p["title"]: p["targets"][0]["rawSql"] for p in _panels_of(DASHBOARDS["stagetrace-trace-lookup"])}

    def table(title: str, request_id: str) -> list[dict]:
        names, _, rows = run(demo_store, expand(lookup[title], window, {"request_id": Variable(request_id)}))
        return [dict(zip(names, row)) for row in rows]

    request_id = truth_request(demo_store, "rdma_local_ack_timeout_err_total")
    (summary,) = table("Request", request_id)
    assert summary["request_id"] == request_id
    spans = demo_store.client.command(
        "SELECT count() FROM otel_traces WHERE TraceId = {t:String}", parameters={"t": summary["trace_id"]}
    )
    trace = table("Trace", request_id)
    assert len(trace) == int(spans) == 6 and {row["traceID"] for row in trace} == {summary["trace_id"]}
    assert [row["stage"] for row in table("Stages", request_id)] == [
        "retrieval",
        "cache",
        "context_assembly",
        "allreduce",
        "decode",
    ]
    assert [row["host"] for row in table("Hosts", request_id)] == [summary["host"]]
    counters = {row["metric"]: row for row in table("Counters over the request's window", request_id)}
    assert counters["rdma_local_ack_timeout_err_total"]["during_request"] >= 1  # the injected NIC timeout

    xid_victim = truth_request(demo_store, "gpu_xid_errors_total")
    xid = {row["metric"]: row for row in table("Counters over the request's window", xid_victim)}[
        "gpu_xid_errors_total"
    ]
    assert xid["during_request"] + xid["in_10_min_before"] >= 1  # the XID that corrupted its decode
    assert table("Request", xid_victim)[0]["deviates"] == "yes"


# ---------------------------------------------------------------------------------------------
# Counter arithmetic in SQL: resets and series that appear at their first event


def _insert_counter(
    store, metric: str, host: str, labels: dict, samples: list[tuple[datetime, float]], start: datetime
):
    rows = [({"host.name": host}, metric, labels, start, at, value, 2, True) for at, value in samples]
    store.client.insert(
        "otel_metrics_sum",
        rows,
        database=store.database,
        column_names=(
            "ResourceAttributes",
            "MetricName",
            "Attributes",
            "StartTimeUnix",
            "TimeUnix",
            "Value",
            "AggregationTemporality",
            "IsMonotonic",
        ),
    )


def _panel_sql(uid: str, title: str) -> str:
    (panel,) = [p for p in _panels_of(DASHBOARDS[uid]) if p["title"] == title]
    return panel["targets"][0]["rawSql"]


def test_counter_panels_treat_a_decrease_as_a_reset(demo_store):
    base = datetime(2020, 3, 1, 12, 0, tzinfo=timezone.utc)
    minute = timedelta(minutes=1)
    values = [10, 20, 5, 15, 15]  # a driver reload between 20 and 5
    _insert_counter(
        demo_store,
        "rdma_local_ack_timeout_err_total",
        "reset-test",
        {"device": "mlx5_9", "port": "1"},
        [(base + i * minute, v) for i, v in enumerate(values)],
        base - minute,
    )
    context = QueryContext(base - minute, base + 10 * minute, interval_ms=60_000)
    sql = expand(
        _panel_sql("stagetrace-rdma", "Retransmits and ack timeouts"),
        context,
        {"host": Variable(("reset-test",)), "nic": Variable((ALL,))},
    )
    names, _, rows = run(demo_store, sql)
    per_second = [float(row[names.index("rate")]) for row in rows]
    assert min(per_second) >= 0
    assert sum(per_second) * 60 == pytest.approx(10 + 5 + 10 + 0)  # 20->5 counts 5, never -15


def test_xid_panel_counts_a_series_first_event_and_not_history_before_the_range(demo_store):
    base = datetime(2020, 4, 1, 12, 0, tzinfo=timezone.utc)
    minute = timedelta(minutes=1)
    uuid_new, uuid_old = "GPU-new-0000", "GPU-old-0000"
    labels = {"gpu": "0", "model": "H200", "xid": "79"}
    # appears at its first event inside the range, then a second event
    _insert_counter(
        demo_store,
        "gpu_xid_errors_total",
        "xid-test",
        {**labels, "uuid": uuid_new},
        [(base + 2 * minute, 1), (base + 3 * minute, 1), (base + 4 * minute, 2)],
        base,
    )
    # three events long before the range, one inside it
    _insert_counter(
        demo_store,
        "gpu_xid_errors_total",
        "xid-test",
        {**labels, "gpu": "1", "uuid": uuid_old},
        [(base - 30 * minute, 3), (base + 2 * minute, 3), (base + 3 * minute, 4)],
        base - 60 * minute,
    )
    context = QueryContext(base, base + 10 * minute, interval_ms=60_000)
    sql = expand(
        _panel_sql("stagetrace-gpu", "XID events per interval"),
        context,
        {"host": Variable(("xid-test",)), "gpu": Variable((ALL,))},
    )
    names, _, rows = run(demo_store, sql)
    events: dict[str, float] = {}
    for row in rows:
        events[row[names.index("gpu")]] = events.get(row[names.index("gpu")], 0) + float(row[names.index("events")])
    assert events == {"xid-test GPU 0": 2, "xid-test GPU 1": 1}


def test_gpu_dashboard_names_the_demos_gpu_shared_through_mps(demo_store, window):
    """The demo's last node shares GPU 3 between two pods through MPS replicas and advertises 2 devices per GPU:
    one card with two allocations and two MPS clients, and its node's GPUs counted twice. The other nodes run no
    kubelet, and the panels name none of them."""
    from stagetrace.demo import faults

    shared = faults.plan(4)[-1].host
    everything = {"host": Variable((ALL,)), "gpu": Variable((ALL,))}

    def table(title: str) -> list[dict]:
        names, _, rows = run(demo_store, expand(_panel_sql("stagetrace-gpu", title), window, everything))
        return [dict(zip(names, row)) for row in rows]

    counts = {row["host"]: row for row in table("What the scheduler counts")}
    assert (counts[shared]["advertised"], counts[shared]["physical_gpus"], counts[shared]["nvml_gpus"]) == (8, 4, 4)
    assert counts[shared]["verdict"] == "each GPU counted twice"
    assert set(counts) == {shared}
    held = [row for row in table("Who holds each GPU") if row["allocations"] == 2]
    assert sorted((row["host"], row["gpu"], row["namespace"], row["pod"], row["mps_clients"]) for row in held) == [
        (shared, "3", "rag-demo", "worker-0", 2),
        (shared, "3", "voice", "tts-0", 2),
    ]
    assert len({row["uuid"] for row in held}) == 1 and len({row["device_id"] for row in held}) == 2


def test_compare_shows_the_stage_where_a_request_left_its_baseline(demo_store, window):
    """A request the demo's all-reduce switched to the tree algorithm, against the baseline `explain` chooses for it
    (the nearest request with the same input and the majority output, in the same rollout epoch): the first row whose output differs while its input is the same is the all-reduce, and the
    attribute that differs there is the algorithm."""
    request_id = truth_request(demo_store, "allreduce.algorithm")
    baseline = Explainer(demo_store).explain(request_id).to_json()["baseline"]["request_id"]  # as explain chooses it
    sql = expand(
        compare.STAGES_SQL, window, {"request_id": Variable(request_id), "other_request_id": Variable(baseline)}
    )
    names, _, rows = run(demo_store, sql)
    stages = [dict(zip(names, row)) for row in rows]
    first = next(s for s in stages if s["output"] == "different")
    assert (first["stage"], first["input"]) == ("allreduce", "same"), stages
    assert "allreduce.algorithm: tree -> ring" in first["differing_attributes"], first
    assert [s["output"] for s in stages if s["stage"] in ("retrieval", "cache", "context_assembly")] == ["same"] * 3
