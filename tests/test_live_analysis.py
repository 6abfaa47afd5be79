"""Live attribution: the analysis runs by itself and its answer lands where users look.

A real `stagetrace agent` with `--analyse-every` receives live traffic from the official OTLP exporter (timestamps of
now) for three hosts of one service; partway through, one host starts serving with another KV-cache dtype and its
decode outputs change. Without anyone running a command, `stagetrace_divergences` names those requests (stage
decode, top cause the setting), and only those; `/metrics` counts them by cause; every request sent is stored.
The lease and the restarts run against a server store: ClickHouse's HTTP interface answered by the embedded engine
in a process of its own (`benchmarks.clickhouse_http`, as tests/test_agent.py uses it), shared by two
`stagetrace analyse` processes.
"""

import hashlib
import importlib.util
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import clickhouse_connect
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind

from stagetrace.analysis import live

_spec = importlib.util.spec_from_file_location("stagetrace_tests_agents", Path(__file__).with_name("agents.py"))
agents = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = agents
_spec.loader.exec_module(agents)

HOSTS = ("gpu-a", "gpu-b", "gpu-c")
INPUTS = 4  # distinct prompts, each asked again and again on every host
PERIOD_S = 2


def digest(*parts) -> str:
    return hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=16).hexdigest()


def serve(otlp: str, host: str, requests: list[tuple[str, int, str]]) -> None:
    """Requests served by ``host``: (request ID, input, KV-cache dtype), each a root and three stage spans."""
    provider = TracerProvider(resource=Resource.create({"service.name": "chat", "host.name": host}))
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(f"{otlp}/v1/traces", timeout=10), schedule_delay_millis=200)
    )
    tracer = provider.get_tracer("chat")
    for request_id, prompt, kv_dtype in requests:
        context, output = digest("context", prompt), digest("tokens", prompt, kv_dtype == "fp8")
        with tracer.start_as_current_span(
            "inference.request",
            kind=SpanKind.SERVER,
            attributes={
                "stagetrace.request.id": request_id,
                "stagetrace.input.digest": digest("input", prompt),
                "stagetrace.output.digest": output,
            },
        ):
            for stage, into, out, attributes in (
                ("retrieval", digest("input", prompt), digest("docs", prompt), {"retrieval.index.version": "v7"}),
                ("context_assembly", digest("docs", prompt), context, {"context.template.version": "t2"}),
                (
                    "decode",
                    context,
                    output,
                    {"gpu.uuid": f"GPU-{host}", "decode.kv_cache_dtype": kv_dtype, "decode.batch_size": 8},
                ),
            ):
                with tracer.start_as_current_span(
                    stage,
                    attributes={
                        "stagetrace.stage": stage,
                        "stagetrace.stage.input_digest": into,
                        "stagetrace.stage.output_digest": out,
                        **attributes,
                    },
                ):
                    pass
    provider.shutdown()


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read().decode()


def test_a_hosts_new_kv_cache_dtype_reaches_the_table_and_metrics_within_two_periods(tmp_path):
    agent = agents.Agent(
        tmp_path,
        "--analyse-every",
        f"{PERIOD_S}s",
        env={"STAGETRACE_ANALYSE_SETTLE": "1s", "STAGETRACE_ANALYSE_LOOKBACK": "10m"},
    )
    try:
        before = {h: [(f"{h}-{i:03d}", i % INPUTS, "auto") for i in range(12)] for h in HOSTS}
        for host in HOSTS:
            serve(agent.endpoints["otlp"], host, before[host])
        changed = [(f"gpu-c-fp8-{i:03d}", i % INPUTS, "fp8") for i in range(8)]
        after = {
            "gpu-a": [(f"gpu-a-{i:03d}", i % INPUTS, "auto") for i in range(12, 20)],
            "gpu-b": [(f"gpu-b-{i:03d}", i % INPUTS, "auto") for i in range(12, 20)],
            "gpu-c": changed,
        }
        for host in HOSTS:
            serve(agent.endpoints["otlp"], host, after[host])
        sent = sum(len(r) for r in before.values()) + sum(len(r) for r in after.values())
        last_sent = time.monotonic()
        client = clickhouse_connect.get_client(host="127.0.0.1", port=agent.query_port, database="stagetrace")
        counted = (
            'stagetrace_deviating_requests_total{cause="decode.kv_cache_dtype",host="node-a",service="chat",'
            f'stage="decode"}} {float(len(changed))}'
        )
        rows, metrics = [], ""
        # the pass writes the table's rows, then counts them: poll both, within two periods, the settle delay and slack
        while time.monotonic() - last_sent < 2 * PERIOD_S + 1 + 20:
            rows = client.query(
                "SELECT RequestId, HostName, FirstDivergentStage, TopCauseName, TopCauseValue, "
                "TopCauseBaselineValue FROM stagetrace_divergences FINAL ORDER BY RequestId"
            ).result_rows
            metrics = scrape(agent.endpoints["metrics"])
            if len(rows) >= len(changed) and counted in metrics:
                break
            time.sleep(0.5)
        waited = time.monotonic() - last_sent
        assert {r[0] for r in rows} == {request_id for request_id, _, _ in changed}, rows
        assert {r[1:] for r in rows} == {("gpu-c", "decode", "decode.kv_cache_dtype", "fp8", "auto")}
        assert counted in metrics, [line for line in metrics.splitlines() if "deviating" in line]
        assert waited < 2 * PERIOD_S + 1 + 20
        assert "stagetrace_analysis_lag_seconds" in metrics and "stagetrace_analysed_requests_total" in metrics
        assert client.command("SELECT count() FROM stagetrace_requests") == sent
    finally:
        log = agent.stop()
    assert "analysing divergences every 2s" in log


# -- a server store shared by analysers in processes of their own ---------------------------------------------


class Server:
    """ClickHouse's HTTP interface over an embedded store, in a process of its own (kill it: the store is down)."""

    def __init__(self, path: Path):
        self.path, self.port = path, agents.free_port()
        self.dsn = f"http://default@127.0.0.1:{self.port}/stagetrace"
        self.start()

    def start(self):
        self.process = agents.start_server_store(self.path, self.port)

    def stop(self):
        self.process.kill()
        self.process.wait(timeout=30)

    def client(self):
        return clickhouse_connect.get_client(host="127.0.0.1", port=self.port, database="stagetrace")


def analyse(dsn: str, log: Path, listen: str = "none") -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stagetrace",
            "analyse",
            "--store",
            dsn,
            "--every",
            "1s",
            "--settle",
            "0",
            "--lookback",
            "2h",
            "--listen",
            listen,
        ],
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        env=agents.ENV,
    )


@pytest.fixture(scope="module")
def server_store(tmp_path_factory):
    """A server store the demo filled, and what `stagetrace divergences` finds in it (the reference)."""
    directory = tmp_path_factory.mktemp("server-store")
    server = Server(directory / "store")
    demo = agents.stagetrace("demo", "--requests", "200", "--nodes", "2", "--store", server.dsn, "--json")
    assert demo.returncode == 0, demo.stderr
    reference = agents.stagetrace("divergences", "--since", "2h", "--limit", "0", "--json", "--store", server.dsn)
    assert reference.returncode == 0, reference.stderr
    expected = {item["request_id"] for group in json.loads(reference.stdout)["groups"] for item in group["deviating"]}
    assert expected
    server.client().command("TRUNCATE TABLE stagetrace_divergences")  # the reference run wrote its rows
    yield server, expected
    server.stop()


def holder(server: Server) -> str:
    rows = server.client().query("SELECT Holder FROM stagetrace_analyser ORDER BY Renewed DESC LIMIT 1").result_rows
    return rows[0][0] if rows else ""


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (found := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.3)
    return found


def test_one_analyser_per_store_and_a_kill_hands_over_without_gaps_or_duplicates(server_store, tmp_path):
    server, expected = server_store
    first = analyse(server.dsn, tmp_path / "first.log")
    try:
        wait_for(lambda: f"/{first.pid}/" in holder(server), 60, "the first analyser never took the lease")
        second = analyse(server.dsn, tmp_path / "second.log")
        time.sleep(3)  # three of its periods: it waits while the first renews
        assert f"/{first.pid}/" in holder(server)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        killed = time.monotonic()
        wait_for(lambda: f"/{second.pid}/" in holder(server), 30, "the second analyser never took over")
        assert time.monotonic() - killed < 2 * 1 + 5  # within two periods (and the time a pass takes)
        wait_for(
            lambda: server.client().command("SELECT uniqExact(RequestId) FROM stagetrace_divergences") >= len(expected),
            60,
            "the deviating requests never all arrived",
        )
        client = server.client()
        rows = client.query("SELECT RequestId FROM stagetrace_divergences FINAL").result_rows
        assert sorted(r[0] for r in rows) == sorted(expected)  # every one, each once
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=30) == 0
        assert "Traceback" not in (tmp_path / "second.log").read_text()
    finally:
        for process in (first, locals().get("second")):
            if process is not None and process.poll() is None:
                process.kill()


def test_the_store_down_for_a_while_is_one_log_line_a_growing_lag_and_a_recovery(server_store, tmp_path):
    server, expected = server_store
    port = agents.free_port()
    log = tmp_path / "analyse.log"
    process = analyse(server.dsn, log, f"127.0.0.1:{port}")

    def metric(name: str) -> float:
        try:
            return _value(scrape(f"http://127.0.0.1:{port}/metrics"), name)
        except OSError:  # not serving yet
            return 0.0

    try:
        wait_for(lambda: metric("stagetrace_analysis_passes_total") >= 1, 60, "no pass")
        server.stop()
        time.sleep(4)  # four periods with the store down
        failures = metric("stagetrace_analysis_failures_total")
        assert failures >= 2 and metric("stagetrace_analysis_lag_seconds") >= 3
        server.start()
        wait_for(lambda: metric("stagetrace_analysis_lag_seconds") < 3, 30, "the analyser did not recover")
        assert process.poll() is None
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    text = log.read_text()
    assert "Traceback" not in text
    assert text.count("live analysis failed") == 1 and failures >= 2


def _value(exposition: str, name: str) -> float:
    for line in exposition.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# -- faults the analyser meets in a fleet ------------------------------------------------------------------------

_fleet_spec = importlib.util.spec_from_file_location("stagetrace_tests_fleet", Path(__file__).with_name("fleet.py"))
fleet = importlib.util.module_from_spec(_fleet_spec)
sys.modules[_fleet_spec.name] = fleet
_fleet_spec.loader.exec_module(fleet)


def _traffic(store, now_ns: int, ahead: dict[str, int] | None = None) -> dict:
    """Hosts a..d serving the same prompts for five minutes before ``now_ns``, d's decode outputs changed; a host in
    ``ahead`` stamps its spans that many ns late of the truth (its clock runs ahead)."""
    recorded = fleet.Fleet(store, start_ns=now_ns - 5 * fleet.MINUTE)
    n = 0
    for minute in range(5):
        for host in "abcd" + "".join(ahead or {}):
            for prompt in range(2):
                at = recorded.at(minute, seconds=n % 50) + (ahead or {}).get(host, 0)
                recorded.request(
                    f"{host}-{n}", at, host, prompt=prompt, differs={"decode": "x"} if host in "de" else None
                )
                n += 1
    recorded.flush()
    return recorded.requests


def _listed(store) -> set[str]:
    sql = "SELECT RequestId FROM {db:Identifier}.stagetrace_divergences FINAL"
    return {r[0] for r in store.client.query(sql, parameters={"db": store.database}).result_rows}


def test_a_host_whose_clock_runs_minutes_ahead_is_analysed_when_its_time_comes(store):
    now = time.time_ns()
    requests = _traffic(store, now, ahead={"e": 4 * fleet.MINUTE})
    early = [r for r, v in requests.items() if v["host"] == "e" and v["start_ns"] > now]
    analyser = live.Analyser(store, live.Schedule(every_s=60, settle_s=0, lookback_s=3600), clock=lambda: now)
    assert analyser.step() is not None and analyser.stats.failures == 0
    assert 0 <= analyser.stats.lag_s < 60  # the future counts as now: no lag that grows without end
    listed = _listed(store)
    assert {r for r, v in requests.items() if v["host"] == "d"} <= listed and early and not set(early) & listed
    later = live.Analyser(
        store, live.Schedule(every_s=60, settle_s=0, lookback_s=3600), clock=lambda: now + 5 * fleet.MINUTE
    )
    assert later.step() is not None
    assert set(early) <= _listed(store)


def test_malformed_spans_beside_good_ones_are_no_crash(store, caplog):
    """Rows no well-behaved producer writes (a root without digests, a stage without a request, a request ID of
    ten thousand characters, NUL bytes, a trace ID that is not hex), among real traffic: the pass completes and
    the deviating requests are still named."""
    now = time.time_ns()
    requests = _traffic(store, now)
    store.client.command(
        """
        INSERT INTO {db:Identifier}.otel_traces (Timestamp, TraceId, SpanId, ParentSpanId, SpanName, SpanKind, ServiceName,
                                 ResourceAttributes, SpanAttributes, Duration)
        VALUES (now64(9) - 60, 'not-hex', 's1', '', 'inference.request', 'Server', 'rag', map('host.name', 'x'),
                map('stagetrace.request.id', 'no-digests'), 5),
               (now64(9) - 60, '', 's2', 's1', 'decode', 'Internal', 'rag', map(),
                map('stagetrace.stage', 'decode', 'stagetrace.stage.output_digest', 'zz'), 5),
               (now64(9) - 60, 'ab', 's3', '', 'inference.request', 'Server', 'rag', map('host.name', 'y'),
                map('stagetrace.request.id', repeat('x', 10000), 'stagetrace.input.digest', '\\0\\0',
                    'stagetrace.output.digest', 'out'), 5)""",
        parameters={"db": store.database},
    )
    caplog.set_level("WARNING", logger="stagetrace")
    analyser = live.Analyser(store, live.Schedule(every_s=60, settle_s=0, lookback_s=3600), clock=lambda: now)
    assert analyser.step() is not None and analyser.stats.failures == 0, caplog.text
    assert {r for r, v in requests.items() if v["host"] == "d"} <= _listed(store)
    assert not caplog.records


def test_an_input_group_of_100000_identical_requests(store):
    """One prompt asked 100,000 times in ten minutes (a health check, a popular query), 0.02% of its answers
    deviating: the pass groups them in the store and analyses the deviating ones, without running out of memory."""
    from benchmarks import synthetic

    now = time.time_ns()
    synthetic.fill(store, 100_000, now - 600 * 10**9, seconds=540, group=100_000, deviating_percent=0.02)
    counts = store.client.query(
        "SELECT uniqExact(InputDigest), count() FROM {db:Identifier}.stagetrace_requests",
        parameters={"db": store.database},
    ).result_rows
    assert counts == [(1, 100_000)]
    analyser = live.Analyser(store, live.Schedule(every_s=60, settle_s=0, lookback_s=3600), clock=lambda: now)
    done = analyser.step()
    assert done is not None and analyser.stats.failures == 0
    assert 5 <= done.analysed <= 60 and len(_listed(store)) == done.analysed


def test_the_stalled_analysis_rule_fires_where_requests_arrive_and_no_analyser_runs(store):
    """The deviation alerts read only the analyser's results: the Grafana rule 'Live analysis stalled' says when none
    runs (a server store without `stagetrace analyse`), and stops once one has renewed its lease."""
    from datetime import datetime, timedelta, timezone

    from stagetrace.dashboards import alert_rules
    from tests.grafana_macros import QueryContext, expand

    now = time.time_ns()
    _traffic(store, now)
    (rule,) = [r for r in alert_rules.RULES if r.uid == "stagetrace-analysis-stalled"]
    store.client.database = store.database  # as the Grafana data source sets it
    at = datetime.fromtimestamp(now / 1e9, timezone.utc)

    def seconds_behind(minutes_later: float) -> list:
        moment = at + timedelta(minutes=minutes_later)
        sql = expand(rule.sql, QueryContext(moment - timedelta(seconds=rule.window_s), moment))
        return [row[-1] for row in store.client.query(sql).result_rows]

    (never,) = seconds_behind(0)
    assert never > rule.threshold  # no analyser ever ran here
    live.Analyser(store, live.Schedule(every_s=60, settle_s=0, lookback_s=3600)).step()
    (fresh,) = seconds_behind(1)
    assert fresh < rule.threshold
    (stale,) = seconds_behind(10)
    assert stale > rule.threshold
    assert seconds_behind(60) == []  # no requests in the range: nothing to analyse, no alert


def test_a_pass_groups_only_the_inputs_that_arrived_and_finds_what_the_whole_window_finds(store):
    """The cost of a pass follows the new traffic: it groups only the window's requests whose input arrived in the
    new period, and those groups are whole, so each new request's deviation and baseline are the ones grouping the
    whole window gives."""
    from benchmarks import synthetic
    from stagetrace.analysis import population

    now = time.time_ns()
    synthetic.fill(store, 20_000, now - 3060 * 10**9, seconds=3000, deviating_percent=10)
    synthetic.fill(store, 2_000, now - 60 * 10**9, seconds=60, offset=20_000, deviating_percent=10)
    t0, new_from = now - 3600 * 10**9, now - 60 * 10**9
    whole = population.deviations(store, t0, now)
    grouped = population.deviations(store, t0, now, inputs_from_ns=new_from)
    arrived = {
        r[0]
        for r in store.client.query(
            "SELECT InputDigest FROM {db:Identifier}.stagetrace_requests WHERE Start >= fromUnixTimestamp64Nano({t:Int64})",
            parameters={"db": store.database, "t": new_from},
        ).result_rows
    }
    assert {d.input_digest for d in grouped} == {d.input_digest for d in whole if d.input_digest in arrived}
    assert [d for d in grouped if d.start_ns >= new_from] == [d for d in whole if d.start_ns >= new_from]
    assert any(d.start_ns < new_from for d in grouped) and len(grouped) < len(whole) / 4


def test_a_sample_of_inputs_weighs_settings_as_every_input_does(store):
    """A busy minute puts hundreds of thousands of requests around the ones a pass analyses; the contrast that weighs
    their causes counts one input in k, whole groups chosen by the input's digest. Each setting's divergence rate
    stays what counting every input gives, from about 1/k of the spans."""
    from benchmarks import synthetic
    from stagetrace.analysis import population

    now = time.time_ns()
    synthetic.fill(store, 40_000, now - 600 * 10**9, seconds=540, deviating_percent=5)
    keys = {stage: [f"setting.{stage}"] for stage in ("retrieval", "decode")}
    every = population.contrasts(store, keys, now - 600 * 10**9, now)
    sampled = population.contrasts(store, keys, now - 600 * 10**9, now, sample=4)
    for stage, (key,) in keys.items():
        # one service and model: one peer key per stage
        (whole,), (part,) = ([c for (s, _), c in found.items() if s == stage] for found in (every, sampled))
        spans, sampled_spans = (sum(n for n, _ in c.counts.values()) for c in (whole, part))
        assert spans / 6 < sampled_spans < spans / 2.5
        for value in ("a", "b"):
            rate, n, _ = whole.rate(key, value, counted_as_diverged=False)
            sampled_rate, sampled_n, _ = part.rate(key, value, counted_as_diverged=False)
            assert 0 < sampled_n < n and sampled_rate == pytest.approx(rate, abs=0.05), (stage, value)
        assert part.rate(key, "b", False)[0] > 0.9 > 0.1 > part.rate(key, "a", False)[0]
