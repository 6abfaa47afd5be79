"""`stagetrace agent` as the single-node hub: OTLP in, and its embedded store shared read-only with other processes.

Each agent here is a real `stagetrace agent` process on free loopback ports holding a real embedded store; the
senders are the plain OpenTelemetry SDK with the official OTLP exporter, the readers the `stagetrace` CLI and
clickhouse-connect's ordinary HTTP client.
"""

import importlib.util
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import clickhouse_connect
import pytest
from clickhouse_connect.driver.exceptions import DatabaseError
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind

from stagetrace import schema
from stagetrace.through_agent import Refused, read_only_format
from stagetrace.store import StoreError, StoreLockedError, open_store

_spec = importlib.util.spec_from_file_location("stagetrace_tests_agents", Path(__file__).with_name("agents.py"))
agents = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = agents
_spec.loader.exec_module(agents)
Agent, stagetrace, BASE_ENV, ENV, SYSFS = agents.Agent, agents.stagetrace, agents.BASE_ENV, agents.ENV, agents.SYSFS

FIXTURES = Path(__file__).parent / "fixtures"
VLLM = FIXTURES / "vllm" / "llm_request.json"
VLLM_ID = "chatcmpl-9f1c2e7a4b5d4e3f8a6b1c2d3e4f5a6b"


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    running = Agent(tmp_path_factory.mktemp("hub"))
    yield running
    running.stop()
    assert not (running.store / "agent.json").exists()  # withdrawn on exit


def send_request(otlp: str, request_id: str, compression=Compression.NoCompression, headers=None) -> tuple[str, str]:
    """One pipeline request from the plain SDK through the official OTLP/HTTP exporter; (trace ID, root span ID)."""
    provider = TracerProvider(resource=Resource.create({"service.name": "rag-api", "host.name": "node-a"}))
    exporter = OTLPSpanExporter(f"{otlp}/v1/traces", compression=compression, headers=headers, timeout=10)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("rag-api")
    with tracer.start_as_current_span(
        "inference.request", kind=SpanKind.SERVER, attributes={"stagetrace.request.id": request_id}
    ) as root:
        for stage in ("retrieval", "decode"):
            with tracer.start_as_current_span(stage, attributes={"stagetrace.stage": stage}):
                time.sleep(0.002)
    provider.shutdown()
    context = root.get_span_context()
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


def trace_json(request_id: str, dsn: str, env: dict | None = None, attempts: int = 40) -> dict:
    """`stagetrace trace --json` from another process, retried while the agent's writer catches up."""
    for _ in range(attempts):
        result = stagetrace("trace", request_id, "--json", "--store", dsn, env=env)
        if result.returncode == 0:
            return json.loads(result.stdout)
        assert "no request with id" in result.stderr, result.stderr
        time.sleep(0.5)
    raise AssertionError(f"stagetrace trace {request_id} never found it: {result.stderr}")


@pytest.mark.parametrize("compression", [Compression.NoCompression, Compression.Gzip])
def test_sdk_spans_sent_to_the_agent_are_found_by_trace_from_another_process(agent, compression):
    request_id = f"req-{compression.value}"
    trace_id, _ = send_request(agent.endpoints["otlp"], request_id, compression)
    found = trace_json(request_id, agent.dsn)
    assert found["trace_id"] == trace_id and found["service"] == "rag-api"
    assert [s["stage"] or s["name"] for s in found["spans"]] == ["inference.request", "retrieval", "decode"]


def test_otlp_json_posted_raw_is_found_by_request_id(agent):
    document = json.loads(VLLM.read_text())
    span = document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    span["traceId"], span["spanId"] = "5" * 32, "6" * 16
    span["attributes"] = [a for a in span["attributes"] if a["key"] != "gen_ai.request.id"]
    span["attributes"].append({"key": "stagetrace.request.id", "value": {"stringValue": "json-1"}})
    request = urllib.request.Request(
        f"{agent.endpoints['otlp']}/v1/traces",
        data=json.dumps(document).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert (response.status, json.load(response)) == (200, {})
    assert trace_json("json-1", agent.dsn)["trace_id"] == "5" * 32


def test_a_vllm_llm_request_span_is_found_by_its_request_id_with_its_engine_timings(agent):
    request = urllib.request.Request(
        f"{agent.endpoints['otlp']}/v1/traces", data=VLLM.read_bytes(), headers={"Content-Type": "application/json"}
    )
    urllib.request.urlopen(request, timeout=10).close()
    found = trace_json(VLLM_ID, agent.dsn)
    (span,) = found["spans"]
    assert (found["request_id"], found["service"], span["name"], span["kind"]) == (
        VLLM_ID,
        "vllm",
        "llm_request",
        "Server",
    )
    assert span["engine_ms"] == pytest.approx(
        {
            "time_in_queue": 12.3,
            "time_to_first_token": 87.1,
            "time_in_model_prefill": 74.8,
            "time_in_model_decode": 1203.4,
            "time_in_model_inference": 1278.2,
            "e2e": 1292.1,
        }
    )
    assert span["attributes"]["gen_ai.usage.completion_tokens"] == "128" and span["duration_ms"] == pytest.approx(
        1292.1
    )
    shown = stagetrace("trace", VLLM_ID, "--store", agent.dsn)
    assert shown.returncode == 0, shown.stderr
    assert f"request {VLLM_ID}" in shown.stdout and "llm_request" in shown.stdout
    assert (
        "llm_request (vllm): queue 12.3 · ttft 87.1 · prefill 74.8 · decode 1203.4 · inference 1278.2 · e2e 1292.1 ms"
        in shown.stdout
    )


def test_with_a_propagated_traceparent_the_engine_span_joins_the_pipeline_trace(agent):
    trace_id, root_span = send_request(agent.endpoints["otlp"], "pipeline-7")
    document = json.loads(VLLM.read_text())
    span = document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    # what vLLM does with the traceparent header the app sent: same trace, the app's span as parent
    engine_id = "chatcmpl-joined"
    span.update(traceId=trace_id, parentSpanId=root_span, spanId="7" * 16)
    for attribute in span["attributes"]:
        if attribute["key"] == "gen_ai.request.id":
            attribute["value"]["stringValue"] = engine_id
    now = time.time_ns()
    span.update(startTimeUnixNano=str(now - 2_000_000_000), endTimeUnixNano=str(now - 700_000_000))
    request = urllib.request.Request(
        f"{agent.endpoints['otlp']}/v1/traces",
        data=json.dumps(document).encode(),
        headers={"Content-Type": "application/json"},
    )
    urllib.request.urlopen(request, timeout=10).close()
    for _ in range(40):  # by the app's request ID: the engine span is in the pipeline's trace, under its root
        joined = trace_json("pipeline-7", agent.dsn)
        if len(joined["spans"]) == 4:
            break
        time.sleep(0.5)
    engine = next(s for s in joined["spans"] if s["name"] == "llm_request")
    assert engine["parent_span_id"] == root_span and engine["engine_ms"]["time_to_first_token"] == pytest.approx(87.1)
    by_engine_id = trace_json(engine_id, agent.dsn)  # and by the engine's: the whole pipeline around it
    assert by_engine_id["trace_id"] == trace_id and len(by_engine_id["spans"]) == 4
    assert min(s["start"] for s in by_engine_id["spans"]) == by_engine_id["start"]


def test_clickhouse_connect_reads_through_the_agent_and_writes_are_refused(agent):
    send_request(agent.endpoints["otlp"], "cc-1")
    client = clickhouse_connect.get_client(host="127.0.0.1", port=agent.query_port)
    for _ in range(40):  # the views' rows land just after the span's: wait for both
        rows = client.query(
            "SELECT SpanName, SpanKind, SpanAttributes FROM stagetrace.otel_traces "
            "WHERE SpanAttributes['stagetrace.request.id'] = {rid:String}",
            parameters={"rid": "cc-1"},
        ).result_rows
        if rows and client.command("SELECT count() FROM stagetrace.stagetrace_requests WHERE RequestId = 'cc-1'"):
            break
        time.sleep(0.5)
    assert rows == [("inference.request", "Server", {"stagetrace.request.id": "cc-1"})]
    assert client.command("SELECT count() FROM stagetrace.stagetrace_requests WHERE RequestId = 'cc-1'") == 1
    for write, code in (
        (lambda: client.command("INSERT INTO stagetrace.otel_traces (SpanName) VALUES ('x')"), 164),  # READONLY
        (lambda: client.insert("otel_traces", [("x",)], column_names=["SpanName"], database="stagetrace"), 164),
        (lambda: client.command("DROP TABLE stagetrace.otel_traces"), 164),
        (lambda: client.query("SELECT 1; DROP TABLE stagetrace.otel_traces"), 164),
        (lambda: client.query("SELECT 1 INTO OUTFILE '/tmp/stagetrace-hub-outfile'"), 164),
        (lambda: client.query("SELECT * FROM file('/etc/passwd', 'LineAsString')"), 497),  # ACCESS_DENIED
        (lambda: client.query("SELECT 1 SETTINGS readonly = 0"), 164),
    ):
        with pytest.raises(DatabaseError) as refused:
            write()
        assert refused.value.code == code, refused.value
    assert client.command("SELECT count() FROM stagetrace.otel_traces WHERE SpanName = 'x'") == 0
    assert urllib.request.urlopen(f"{agent.endpoints['query']}/ping", timeout=5).read() == b"Ok.\n"


def test_the_endpoint_speaks_plain_clickhouse_http(agent):
    query = urllib.parse.urlencode(
        {"query": "SELECT {n:UInt8} + 1 AS x, {s:String} AS s FORMAT JSONEachRow", "param_n": "41", "param_s": "it's"}
    )
    with urllib.request.urlopen(f"{agent.endpoints['query']}/?{query}", timeout=10) as response:
        assert json.loads(response.read()) == {"x": 42, "s": "it's"}
        assert response.headers["X-ClickHouse-Format"] == "JSONEachRow"
    request = urllib.request.Request(
        f"{agent.endpoints['query']}/?database=stagetrace", data=b"SELECT count() > 0 FROM otel_metrics_sum"
    )
    with urllib.request.urlopen(request, timeout=10) as response:  # a POST body, the default format
        assert response.read() == b"1\n" and response.headers["X-ClickHouse-Format"] == "TabSeparated"


def test_trace_and_schema_work_while_the_agent_holds_the_store(agent):
    send_request(agent.endpoints["otlp"], "schema-1")
    printed = stagetrace("schema", "--print", "--store", agent.dsn)
    assert printed.returncode == 0 and "CREATE TABLE IF NOT EXISTS `stagetrace`.`otel_traces`" in printed.stdout
    applied = stagetrace("schema", "--store", agent.dsn)
    assert (applied.returncode, applied.stdout.strip()) == (
        0,
        f"schema version {schema.SCHEMA_VERSION} already up to date in {agent.dsn}",
    )
    assert trace_json("schema-1", agent.dsn)["request_id"] == "schema-1"
    missing = stagetrace("trace", "no-such-request", "--store", agent.dsn)
    assert (
        missing.returncode == 1
        and missing.stderr == f"stagetrace: no request with id 'no-such-request' in {agent.dsn}\n"
    )


# What a lookup through the agent needs none of: the embedded engine and its driver, the span SDK, the collectors'
# libraries, array libraries. Each costs tens of milliseconds of start-up on a command run in loops and scripts.
HEAVY = {
    "chdb",
    "clickhouse_connect",
    "numpy",
    "pyarrow",
    "pandas",
    "opentelemetry",
    "prometheus_client",
    "pynvml",
    "grpc",
    "google",
    "torch",
}
LOADED_BY_MAIN = """
import contextlib, io, json, sys
from stagetrace.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    code = main(sys.argv[1:])
print(json.dumps({"code": code, "out": out.getvalue(), "loaded": sorted({m.split(".")[0] for m in sys.modules})}))
"""


@pytest.mark.parametrize("output", ["--json", "text"])
def test_trace_through_the_agent_loads_neither_the_embedded_engine_nor_heavy_libraries(agent, output):
    send_request(agent.endpoints["otlp"], "light-1")
    trace_json("light-1", agent.dsn)  # stored
    args = ["trace", "light-1", "--store", agent.dsn, *(["--json"] if output == "--json" else [])]
    result = subprocess.run(
        [sys.executable, "-c", LOADED_BY_MAIN, *args], capture_output=True, text=True, env=ENV, timeout=120
    )
    assert result.returncode == 0, result.stderr
    run = json.loads(result.stdout)
    assert run["code"] == 0 and "light-1" in run["out"] and "decode" in run["out"]
    assert HEAVY & set(run["loaded"]) == set()
    assert ("rich" in run["loaded"]) == (output == "text")  # the table is drawn with rich; JSON needs none of it


def test_open_store_falls_back_read_only_and_refuses_writes_in_one_line(agent):
    with pytest.raises(StoreLockedError, match="is in use by process"):
        open_store(agent.dsn, agent_fallback=False)
    with open_store(agent.dsn) as store:
        assert store.read_only and store.client.command("SELECT 1") == 1
        with pytest.raises(StoreError) as refused:
            store.client.insert("otel_traces", [("x",)], column_names=["SpanName"], database="stagetrace")
    message = str(refused.value)
    assert message == (
        f"store {agent.dsn} is held by the stagetrace agent (pid {agent.process.pid}), which shares it "
        f"read-only: stop the agent to write to it, or send spans over OTLP to "
        f"{agent.endpoints['otlp']}/v1/traces or {agent.endpoints['otlp_grpc']} (gRPC)"
    )
    demo = stagetrace("demo", "--requests", "20", "--nodes", "2", "--store", agent.dsn)
    assert demo.returncode == 2 and demo.stderr == f"stagetrace: {message}\n"


def test_a_stale_agent_file_is_ignored(tmp_path):
    """An agent.json left by an agent that is gone must not redirect readers to whatever listens on its port."""
    other = Agent(tmp_path / "a")
    try:
        record = json.loads((other.store / "agent.json").read_text())
        (other.store / "agent.json").write_text(json.dumps({**record, "pid": 1}))
        result = stagetrace("trace", "x", "--store", other.dsn)
        assert result.returncode == 2 and "is in use by process" in result.stderr
    finally:
        (other.store / "agent.json").write_text(json.dumps(record))
        other.stop()


def test_a_token_guards_otlp_and_queries(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    token_file.chmod(0o600)
    guarded = Agent(tmp_path, "--token-file", str(token_file))
    try:
        assert json.loads((guarded.store / "agent.json").read_text())["token"] is True
        assert "s3cret" not in (guarded.store / "agent.json").read_text()
        bare = urllib.request.Request(
            f"{guarded.endpoints['otlp']}/v1/traces", data=b"", headers={"Content-Type": "application/x-protobuf"}
        )
        with pytest.raises(urllib.error.HTTPError) as unauthorized:
            urllib.request.urlopen(bare, timeout=10)
        assert unauthorized.value.code == 401
        send_request(guarded.endpoints["otlp"], "tok-1", headers={"Authorization": "Bearer s3cret-token"})
        without = stagetrace("trace", "tok-1", "--store", guarded.dsn)
        assert without.returncode == 2 and without.stderr.strip().endswith(
            "whose query endpoint needs a token: set STAGETRACE_AGENT_TOKEN or STAGETRACE_AGENT_TOKEN_FILE"
        )
        assert (
            trace_json("tok-1", guarded.dsn, env={"STAGETRACE_AGENT_TOKEN_FILE": str(token_file)})["request_id"]
            == "tok-1"
        )
        with pytest.raises(DatabaseError) as denied:
            clickhouse_connect.get_client(host="127.0.0.1", port=guarded.query_port)
        assert denied.value.code == 516
        client = clickhouse_connect.get_client(host="127.0.0.1", port=guarded.query_port, access_token="s3cret-token")
        assert client.command("SELECT 1") == 1
    finally:
        log = guarded.stop()
    assert "s3cret" not in log


def test_a_taken_otlp_or_query_address_exits_2_with_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = "127.0.0.1:%d" % taken.getsockname()[1]
        for flag, what in (("--otlp", "OTLP"), ("--otlp-grpc", "OTLP/gRPC"), ("--query-listen", "queries")):
            free = {
                "--otlp": "127.0.0.1:0",
                "--otlp-grpc": "127.0.0.1:0",
                "--query-listen": "127.0.0.1:0",
                flag: address,
            }
            result = stagetrace(
                "agent",
                "--collectors",
                "rdma",
                "--sysfs",
                str(SYSFS),
                "--listen",
                "127.0.0.1:0",
                "--store",
                f"chdb://{tmp_path / 'store'}",
                *(a for f in free.items() for a in f),
            )
            assert (result.returncode, result.stderr.strip().splitlines()) == (
                2,
                [
                    f"stagetrace agent: cannot listen on {address} for {what}: Address already in use "
                    f"(choose another with {flag}, or {flag} none)"
                ],
            )
    assert not (tmp_path / "store" / "agent.json").exists()


@pytest.mark.parametrize(
    "sql, fmt",
    [
        ("SELECT 1", None),
        ("  select 1 format JSONEachRow ;  ", "JSONEachRow"),
        ("WITH 1 AS x SELECT x\n FORMAT Native", "Native"),
        ("(SELECT 1) UNION ALL (SELECT 2)", None),
        ("SHOW TABLES FROM stagetrace", None),
        ("DESCRIBE TABLE stagetrace.otel_traces", None),
        ("EXISTS TABLE stagetrace.otel_traces", None),
        ("-- a comment; with a semicolon\nSELECT ';', 'INTO OUTFILE', `a;b` FROM t /* ; DROP */", None),
        ("SELECT 'it''s; \\' ; still a string'", None),
    ],
)
def test_read_statements_are_admitted(sql, fmt):
    assert read_only_format(sql) == fmt


@pytest.mark.parametrize(
    "sql",
    [
        "INSERT INTO t VALUES (1)",
        "/* SELECT */ DROP TABLE t",
        "SELECT 1; DROP TABLE t",
        "SELECT 1;; SELECT 2",
        "SELECT 1 INTO OUTFILE '/tmp/x'",
        "SELECT 1 /* unterminated ; DROP TABLE t",
        "SELECT 'unterminated ; DROP TABLE t",
        "ALTER TABLE t DELETE WHERE 1",
        "SET readonly = 0",
        "OPTIMIZE TABLE t",
        "SYSTEM FLUSH LOGS",
        "",
        " ; ",
    ],
)
def test_everything_else_is_refused(sql):
    with pytest.raises(Refused):
        read_only_format(sql)


def test_provisioning_an_embedded_store_points_grafana_at_the_agent_that_serves_it(agent, tmp_path):
    """``provision --to-dir`` on the default kind of store (embedded): the data source is the agent's query
    endpoint, and a ClickHouse HTTP client with exactly the provisioned settings reads the spans there."""
    import yaml

    done = stagetrace("provision", "--to-dir", str(tmp_path), "--store", agent.dsn)
    assert done.returncode == 0, done.stderr
    assert f"the agent (pid {agent.process.pid}) serves it at 127.0.0.1:{agent.query_port}" in done.stdout
    assert "--network host" in done.stdout
    (source,) = yaml.safe_load((tmp_path / "datasources" / "stagetrace.yaml").read_text())["datasources"]
    data = source["jsonData"]
    assert (data["host"], data["port"], data["protocol"]) == ("127.0.0.1", agent.query_port, "http")
    send_request(agent.endpoints["otlp"], "grafana-1")
    trace_json("grafana-1", agent.dsn)
    client = clickhouse_connect.get_client(
        host=data["host"], port=data["port"], username=data["username"], database=data["defaultDatabase"]
    )
    assert (
        client.command("SELECT count() FROM otel_traces WHERE SpanAttributes['stagetrace.request.id'] = 'grafana-1'")
        >= 1
    )


def test_the_read_commands_client_returns_what_clickhouse_connect_returns(agent):
    """``through_agent.AgentClient`` (the standard library's HTTP, JSON by column type) against clickhouse-connect
    on the same endpoint, for every type the read commands' queries return, and bound parameters of each kind."""
    import clickhouse_connect

    from stagetrace.through_agent import AgentClient

    url = urllib.parse.urlsplit(agent.endpoints["query"])
    sql = """SELECT {s:String} AS s, {n:Int64} AS n, toUInt64(18446744073709551615) AS big, toFloat64(0.25) AS f,
                    map('k', 'v', 'tab', 'a\tb') AS m, {a:Array(String)} AS a, [[1, 2], [3]] AS nested,
                    toNullable('') AS nothing, CAST(NULL, 'Nullable(Int32)') AS null, true AS yes,
                    toDateTime64('2026-12-03 10:00:00.123456789', 9, 'UTC') AS t, (1, 'x') AS pair,
                    CAST((2, 'y'), 'Tuple(a UInt8, b String)') AS named, toLowCardinality('lc') AS lc,
                    arrayJoin([1, 2]) AS row"""
    parameters = {"s": "it's a \\ back\tslash\nline", "n": -42, "a": ["x'y", "z\\w", ""]}
    ours = AgentClient(url.hostname, url.port, None, "stagetrace")
    theirs = clickhouse_connect.get_client(
        host=url.hostname, port=url.port, compress=False, autogenerate_session_id=False
    )
    try:
        expected = theirs.query(sql, parameters=parameters)
        got = ours.query(sql, parameters=parameters)
        assert got.column_names == tuple(expected.column_names)
        assert got.result_rows == [tuple(row) for row in expected.result_rows]
        assert ours.command("SELECT count() FROM system.one") == 1
    finally:
        ours.close()
        theirs.close()


def _agent_exit(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return stagetrace(
        "agent",
        "--collectors",
        "rdma",
        "--sysfs",
        str(SYSFS),
        "--listen",
        "127.0.0.1:0",
        "--otlp",
        "none",
        "--otlp-grpc",
        "none",
        "--store",
        f"chdb://{tmp_path / 'store'}",
        *args,
    )


def test_a_token_file_others_can_read_is_refused_in_one_line(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    token_file.chmod(0o644)
    refused = _agent_exit(tmp_path, "--token-file", str(token_file))
    assert (refused.returncode, refused.stderr) == (
        2,
        f"stagetrace agent: the token file {token_file} can be read by "
        f"other users (mode 644): chmod 600 {token_file}\n",
    )
    assert "s3cret" not in refused.stderr


def test_the_query_endpoint_does_not_open_off_loopback_without_a_token(tmp_path):
    refused = _agent_exit(tmp_path, "--query-listen", "0.0.0.0:0")
    assert refused.returncode == 2 and refused.stderr.splitlines() == [
        "stagetrace agent: the query endpoint would read the store for anyone who can reach 0.0.0.0:0: give it a "
        "token (--token-file) or require client certificates (--web-config-file), keep it on loopback, or accept "
        "that with --query-open"
    ]
    opened = Agent(tmp_path / "open", "--query-listen", "0.0.0.0:0", "--query-open")
    try:
        assert urllib.request.urlopen(f"http://127.0.0.1:{opened.query_port}/ping", timeout=5).read() == b"Ok.\n"
    finally:
        log = opened.stop()
    assert "the query endpoint listens on 0.0.0.0:0 without a token" in log


def test_the_store_and_agent_json_are_the_owners_alone_and_a_looser_store_is_named_once(tmp_path):
    fresh = Agent(tmp_path / "fresh")
    try:
        assert (fresh.store.stat().st_mode & 0o777, (fresh.store / "agent.json").stat().st_mode & 0o777) == (
            0o700,
            0o600,
        )
    finally:
        log = fresh.stop()
    assert "can be read by other users" not in log
    fresh.store.chmod(0o755)
    again = Agent(tmp_path / "fresh")
    log = again.stop()
    assert log.count(f"store {fresh.store} can be read by other users (mode 755): chmod 700 {fresh.store}") == 1
