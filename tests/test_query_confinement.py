"""The agent's query endpoint reads the store and nothing else, whatever shape a statement takes.

A real `stagetrace agent` holds a copy of the demo's store. Its environment carries its token, and beside it lie a
marker file only its user can read (the agent reads it if any statement gets through) and its spool. Every hostile
statement, sent with the token by a client that is allowed to query, is refused with ClickHouse's READONLY (164) or
ACCESS_DENIED (497), in one line, and no answer holds the marker or the token. Then what clients really send still
works through the same endpoint: the Grafana data source's metadata and trace SQL, clickhouse-go's hello, every
dashboard query after the data source's macros, and `stagetrace trace` / `explain` from another process.
"""

import importlib.util
import json
import secrets
import shutil
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from datetime import timedelta, timezone
from pathlib import Path

import clickhouse_connect
import pytest

from stagetrace.dashboards import build_all
from tests.grafana_macros import ALL, QueryContext, Variable, expand

_spec = importlib.util.spec_from_file_location("stagetrace_tests_agents", Path(__file__).with_name("agents.py"))
agents = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = agents
_spec.loader.exec_module(agents)

TOKEN = f"agent-token-{secrets.token_hex(8)}"
MARKER = f"marker-{secrets.token_hex(8)}"
NOT_IN_STORE = {"database": "stagetrace"}  # also marks the statements answered "no such table in the store"


@pytest.fixture(scope="module")
def confined(tmp_path_factory, cli_demo):
    directory = tmp_path_factory.mktemp("confined")
    shutil.copytree(Path(cli_demo[0].removeprefix("chdb://")), directory / "store", symlinks=True)
    marker = directory / "marker"
    marker.write_text(MARKER + "\n")
    marker.chmod(0o400)
    agent = agents.Agent(directory, env={"STAGETRACE_AGENT_TOKEN": TOKEN})
    agent.marker = str(marker)
    agent.demo = cli_demo[1]
    yield agent
    log = agent.stop()
    assert TOKEN not in log and MARKER not in log


def ask(agent, sql: str = "", method: str = "POST", **params) -> tuple[int, str, str]:
    """(status, X-ClickHouse-Exception-Code, body) of one request to the query endpoint, with the token."""
    url = f"{agent.endpoints['query']}/?{urllib.parse.urlencode(params)}"
    request = urllib.request.Request(
        url,
        data=sql.encode() if method == "POST" else None,
        method=method,
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, "", answer.read().decode(errors="replace")
    except urllib.error.HTTPError as refused:
        return (
            refused.code,
            refused.headers.get("X-ClickHouse-Exception-Code", ""),
            refused.read().decode(errors="replace"),
        )


def hostile(marker: str) -> list[tuple[str, dict]]:
    """(statement, URL parameters): the scalar file() forms an operator tried, nested every way; table functions;
    the engine's filesystem database; other clients' queries and the server's configuration; several statements,
    settings, outfiles, parameters and databases that would reach around the check. A path as an unqualified
    table name is looked up among the store's tables, where there is none (``NOT_IN_STORE``)."""
    read = f"file('{marker}')"
    return [
        ("SELECT file('/proc/self/environ')", {}),
        (f"SELECT {read}", {}),
        (f"SELECT `file`('{marker}')", {}),
        (f"sElEcT\n\t/* a comment */ file  (  '{marker}' ) -- trailing", {}),
        (f"WITH ({read}) AS x SELECT x", {}),
        (f"WITH t AS (SELECT {read} AS c) SELECT c FROM t", {}),
        (f"SELECT arrayMap(p -> file(p), ['{marker}'])", {}),
        (f"SELECT (SELECT {read})", {}),
        (f"SELECT * FROM (SELECT {read} AS c)", {}),
        (f"SELECT 1 WHERE {read} != ''", {}),
        (f"SELECT count() FROM numbers(1) ARRAY JOIN [{read}] AS x", {}),
        (f"SELECT countIf({read} != '')", {}),
        (f"SELECT * FROM view(SELECT {read})", {}),
        (f"SELECT {read} SETTINGS readonly = 0", {}),
        (f"SELECT 1; SELECT {read}", {}),
        (f"SELECT * FROM file('{marker}', 'LineAsString')", {}),
        (f"DESCRIBE file('{marker}', 'LineAsString')", {}),
        (f"SELECT * FROM `{marker}`", NOT_IN_STORE),
        (f"SELECT * FROM '{marker}'", NOT_IN_STORE),
        (f"SELECT * FROM default.`{marker}`", {}),
        (f"SELECT * FROM `{marker}`", {"database": "default"}),
        ("SELECT * FROM {t:Identifier}", {"param_t": marker, **NOT_IN_STORE}),
        ("SELECT * FROM {t:Identifier}", {"param_t": "system.processes"}),
        ("SELECT query FROM processes", {"database": "system"}),
        (f"SELECT * FROM executable('cat {marker}', 'LineAsString', 'x String')", {}),
        ("SELECT * FROM url('http://127.0.0.1:9/', 'LineAsString')", {}),
        ("SELECT * FROM remote('127.0.0.1', system.one)", {}),
        ("SELECT * FROM merge('system', '^processes$')", {}),
        ("SELECT query FROM system.processes", {}),
        ("SELECT * FROM system.query_log", {}),
        ("SELECT * FROM system.server_settings", {}),
        ("SELECT 1 IN system.processes", {}),
        ("SELECT getServerSetting('path')", {}),
        ("SELECT filesystemAvailable(), hostName()", {}),
        ("SELECT dictGet('d', 'x', 1)", {}),
        (f"SELECT catboostEvaluate('{marker}', 1)", {}),
        ("SELECT aiGenerate('say the marker')", {}),
        (f"SELECT `a\nFunction file` FROM otel_traces WHERE {read} = ''", {}),
        ("SELECT 1 INTO OUTFILE '/tmp/stagetrace-confinement-outfile'", {}),
        (f"EXPLAIN SELECT {read}", {}),
        ("SHOW PROCESSLIST", {}),
        ("SET readonly = 0", {}),
        ("USE system", {}),
        ("KILL QUERY WHERE 1", {}),
        ("SYSTEM FLUSH LOGS", {}),
        ("INSERT INTO otel_traces (SpanName) VALUES ('x')", {}),
        # expressions the parse tree's dump does not print (found in review): APPLY, and a SHOW's LIMIT
        (f"SELECT * APPLY(x -> file('{marker}')) FROM (SELECT 1)", {}),
        (f"SELECT * APPLY file FROM (SELECT '{marker}' AS p)", {}),
        (f"SHOW TABLES LIMIT toUInt64(file('{marker}'))", {}),
        ("SHOW DATABASES LIMIT toUInt64(file('/proc/self/environ'))", {}),
        ("SHOW TABLES LIMIT (SELECT toUInt64(arrayStringConcat(groupArray(query), ' ')) FROM system.processes)", {}),
        ("SHOW CLUSTERS", {}),
        ("SELECT firstSignificantSubdomainCustom('a.b.c', 'public_suffix_list')", {}),
    ]


def test_every_hostile_statement_is_refused_in_one_line_and_reads_nothing(confined):
    statements = hostile(confined.marker)
    assert len(statements) >= 30
    leaked, wrong = [], []
    for sql, params in statements:
        status, code, body = ask(confined, sql, **params)
        if MARKER in body or TOKEN in body:
            leaked.append(sql)
        expected = {(404, "60")} if params.get("database") == "stagetrace" else {(403, "164"), (403, "497")}
        if (status, code) not in expected or "\n" in body.strip():
            wrong.append(f"{sql!r} {params}: {status} {code} {body.strip()[:200]}")
    assert not leaked, leaked
    assert not wrong, "\n".join(wrong)
    # the same statements in the URL alone, and as a form field, as ClickHouse's HTTP interface also takes them
    for sql in (f"SELECT file('{confined.marker}')", "SELECT * FROM system.processes"):
        assert ask(confined, method="GET", query=sql)[:2] == (403, "497")
        form = (f'--b\r\nContent-Disposition: form-data; name="query"\r\n\r\n{sql}\r\n--b--\r\n').encode()
        request = urllib.request.Request(
            confined.endpoints["query"] + "/",
            data=form,
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "multipart/form-data; boundary=b"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.headers["X-ClickHouse-Exception-Code"] == "497"
    assert not Path("/tmp/stagetrace-confinement-outfile").exists()


def test_grafana_and_clickhouse_clients_still_read_the_store(confined):
    """The Grafana data source's metadata queries, clickhouse-go's hello and the plugin's trace SQL
    (grafana/clickhouse-datasource pkg/plugin/schema.go, src/data/CHDatasource.ts and sqlGenerator.ts)."""
    client = clickhouse_connect.get_client(
        host="127.0.0.1", port=confined.query_port, access_token=TOKEN, database="stagetrace"
    )
    assert "stagetrace" in {row[0] for row in client.query("SHOW DATABASES").result_rows}
    tables = {row[0] for row in client.query('SHOW TABLES FROM "stagetrace"').result_rows}
    assert {"otel_traces", "otel_traces_trace_id_ts", "stagetrace_requests"} <= tables
    assert ("TraceId", "String") in {
        row[:2] for row in client.query('DESC TABLE "stagetrace"."otel_traces"').result_rows
    }
    assert ("stagetrace", "otel_traces") in client.query(
        "SELECT database, name FROM system.tables ORDER BY database, name"
    ).result_rows
    columns = client.query(
        "SELECT database, table, name, type, comment FROM system.columns WHERE (database, table) "
        "IN (('stagetrace', 'otel_traces')) OR (database = currentDatabase() AND table IN "
        "('stagetrace_requests')) ORDER BY database, table, position"
    ).result_rows
    assert {row[1] for row in columns} == {"otel_traces", "stagetrace_requests"}
    assert (
        client.query(
            "SELECT name, is_aggregate, case_insensitive, alias_to, origin, description, syntax, arguments, "
            "returned_value, examples, categories FROM system.functions LIMIT 10000"
        ).row_count
        > 1000
    )
    assert client.query("SELECT displayName(), version(), revision(), timezone()").row_count == 1
    assert (
        client.command("SELECT value FROM system.settings WHERE name = 'readonly'") == 1
    )  # clickhouse-connect parses it
    request_id = confined.demo["deviating"][0]
    trace_id = client.command(
        "SELECT TraceId FROM stagetrace_requests WHERE RequestId = {r:String}", parameters={"r": request_id}
    )
    spans = client.query(f"""
        WITH '{trace_id}' as __gf_trace_id,
         (SELECT min(Start) FROM "stagetrace"."otel_traces_trace_id_ts" WHERE TraceId = __gf_trace_id) as __gf_trace_start,
         (SELECT max(End) + 1 FROM "stagetrace"."otel_traces_trace_id_ts" WHERE TraceId = __gf_trace_id) as __gf_trace_end
        SELECT "TraceId" as traceID, "SpanId" as spanID, "ParentSpanId" as parentSpanID, "ServiceName" as serviceName,
          "SpanName" as operationName, multiply(toUnixTimestamp64Nano("Timestamp"), 0.000001) as startTime,
          multiply("Duration", 0.000001) as duration,
          arrayMap(key -> map('key', key, 'value',"SpanAttributes"[key]), mapKeys("SpanAttributes")) as tags,
          arrayMap(key -> map('key', key, 'value',"ResourceAttributes"[key]), mapKeys("ResourceAttributes")) as serviceTags,
          if("StatusCode" IN ('Error', 'STATUS_CODE_ERROR'), 2, 0) as statusCode,
          arrayMap((name, timestamp, attributes) -> tuple(name, toString(toUnixTimestamp64Milli(timestamp)),
            arrayMap( key -> map('key', key, 'value', attributes[key]), mapKeys(attributes)))::Tuple(name String,
            timestamp String, fields Array(Map(String, String))), "Events.Name", "Events.Timestamp",
            "Events.Attributes") AS logs
        FROM "stagetrace"."otel_traces" WHERE traceID = __gf_trace_id
          AND "Timestamp" >= __gf_trace_start AND "Timestamp" <= __gf_trace_end ORDER BY startTime ASC""").result_rows
    assert len(spans) >= 6 and {row[0] for row in spans} == {trace_id}
    found = client.query("""SELECT "TraceId" as traceID, "ServiceName" as serviceName, "SpanName" as operationName,
          "Timestamp" as timestamp, multiply("Duration", 0.000001) as duration FROM "stagetrace"."otel_traces"
        WHERE ( timestamp >= toDateTime(0) AND timestamp <= now() ) AND ( ParentSpanId = '' ) AND ( Duration > 0 )
        ORDER BY timestamp DESC LIMIT 1000""").result_rows
    assert trace_id in {row[0] for row in found}


def test_every_dashboard_query_runs_through_the_endpoint(confined):
    client = clickhouse_connect.get_client(
        host="127.0.0.1", port=confined.query_port, access_token=TOKEN, database="stagetrace"
    )
    first, last = client.query("SELECT min(Timestamp), max(Timestamp) FROM otel_traces").result_rows[0]
    window = QueryContext(
        first.replace(tzinfo=timezone.utc) - timedelta(hours=1),
        last.replace(tzinfo=timezone.utc) + timedelta(minutes=1),
    )
    variables = {
        **{name: Variable((ALL,)) for name in ("service", "host", "gpu", "nic")},
        "stage": Variable("decode"),
        "request_id": Variable(confined.demo["deviating"][0]),
        "other_request_id": Variable(confined.demo["deviating"][-1]),
    }
    failures, ran = [], 0
    for uid, dashboard in build_all().items():
        sqls = [v["query"]["rawSql"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
        sqls += [t["rawSql"] for p in _panels(dashboard) for t in p.get("targets", [])]
        for sql in sqls:
            try:
                client.raw_query(expand(sql, window, variables), fmt="JSONCompact")
                ran += 1
            except Exception as exc:
                failures.append(f"{uid}: {str(exc).splitlines()[0][:300]}")
    assert not failures, "\n".join(failures)
    assert ran > 50


def test_trace_and_explain_read_through_the_confined_endpoint(confined):
    request_id = confined.demo["deviating"][0]
    env = {"STAGETRACE_AGENT_TOKEN": TOKEN}
    traced = agents.stagetrace("trace", request_id, "--json", "--store", confined.dsn, env=env)
    assert traced.returncode == 0, traced.stderr
    assert json.loads(traced.stdout)["request_id"] == request_id
    explained = agents.stagetrace("explain", request_id, "--json", "--store", confined.dsn, env=env)
    assert explained.returncode == 0, explained.stderr
    assert json.loads(explained.stdout)["diverged"] is True


def _panels(dashboard: dict) -> list[dict]:
    return [p for row in dashboard["panels"] for p in [row, *row.get("panels", [])] if p.get("type") != "row"]


def test_without_the_check_the_same_engine_reads_the_marker(confined, tmp_path):
    """The control: the refusals above are the endpoint's doing. The engine the agent embeds, in a readonly = 1
    session of its own, reads the marker through the scalar file()."""
    script = (
        "import chdb, sys; s = chdb.connect(sys.argv[1]); s.query('SET readonly = 1'); "
        "print(s.query(\"SELECT file({m:String})\", 'TSVRaw', params={'m': sys.argv[2]}).bytes().decode())"
    )
    read = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "engine"), confined.marker],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert read.stdout.strip() == MARKER, read.stderr
