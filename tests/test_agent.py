"""`stagetrace agent` scraped by a real Prometheus and writing to the real embedded store; `stagetrace collect`."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from grpc import Compression
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from prometheus_client.parser import text_string_to_metric_families

from stagetrace.settings import parse_duration as parse_interval
from stagetrace.cli import build_parser
from stagetrace.collectors.base import Node, Options
from stagetrace.collectors.rdma import RdmaCollector
from stagetrace.exporters.prometheus import parse_listen, serve
from stagetrace.store import open_store

SYSFS = Path(__file__).parent / "fixtures" / "node" / "sys"
TRANSMIT_WORDS = int((SYSFS / "class/infiniband/mlx5_3/ports/1/counters/port_xmit_data").read_text())
ENV = {**os.environ, "STAGETRACE_HOST": "node-a"}


def stagetrace(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stagetrace", *args], capture_output=True, text=True, env=ENV, timeout=120, **kwargs
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, probe, timeout: float = 30.0, process: subprocess.Popen | None = None):
    """Poll ``probe`` until it returns something truthy; fail with ``what`` when time runs out or ``process`` exits."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = probe()
        except OSError:
            result = None
        if result:
            return result
        if time.monotonic() > deadline or (process is not None and process.poll() is not None):
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.2)


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def test_interval_and_listen_parsing():
    assert [parse_interval(t) for t in ("500ms", "5s", "1m", "1.5h", "10d", "2w")] == [
        0.5,
        5.0,
        60.0,
        5400.0,
        864000.0,
        1209600.0,
    ]
    for bad in ("5", "0s", "-1s", "5x", "", "1y"):
        with pytest.raises(ValueError, match="write e.g. 500ms, 5s, 1m, 1h, 10d or 2w"):
            parse_interval(bad)
    assert parse_listen("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_listen("[::1]:9464") == ("::1", 9464)
    assert parse_listen(":9464") == ("127.0.0.1", 9464)  # loopback unless told otherwise
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        parse_listen("localhost")


def test_metrics_are_collected_at_scrape_time():
    collector = RdmaCollector(Options(sysfs=SYSFS, host="node-a"))
    server = serve(Node([collector], "node-a"), "127.0.0.1:0")
    try:
        with urllib.request.urlopen(server.url, timeout=5) as response:
            first = response.read().decode()
        collector.options.sysfs = Path("/nonexistent")  # the next scrape reads the source again
        with urllib.request.urlopen(server.url, timeout=5) as response:
            second = response.read().decode()
    finally:
        server.close()
    sent = {"host": "node-a", "device": "mlx5_3", "port": "1"}
    assert exposed(first, "rdma_port_transmit_bytes_total", sent) == 4 * TRANSMIT_WORDS
    assert exposed(second, "stagetrace_collector_success", {"host": "node-a", "collector": "rdma"}) == 0
    assert exposed(second, "rdma_port_transmit_bytes_total", sent) is None


def exposed(text: str, name: str, labels: dict):
    """A sample's value in a text exposition, or None."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return None


def test_collect_once_as_json():
    result = stagetrace("collect", "--once", "--format", "json", "--collectors", "rdma", "--sysfs", str(SYSFS))
    assert result.returncode == 0, result.stderr
    samples = json.loads(result.stdout)
    sent = [s for s in samples if s["name"] == "rdma_port_transmit_bytes_total" and s["labels"]["device"] == "mlx5_3"]
    assert sent == [
        {
            "name": "rdma_port_transmit_bytes_total",
            "type": "counter",
            "help": "Data bytes transmitted (port_xmit_data x 4).",
            "labels": {"host": "node-a", "device": "mlx5_3", "port": "1"},
            "value": 4 * TRANSMIT_WORDS,
        }
    ]
    success = [s for s in samples if s["name"] == "stagetrace_collector_success"]
    assert [(s["labels"]["collector"], s["value"]) for s in success] == [("rdma", 1)]


def test_collect_once_passes_promtool_check_metrics(component):
    promtool = component("promtool", package="prometheus")
    result = stagetrace("collect", "--once", "--collectors", "rdma", "--sysfs", str(SYSFS))
    assert result.returncode == 0, result.stderr
    check = subprocess.run([promtool, "check", "metrics"], input=result.stdout, capture_output=True, text=True)
    assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), check.stdout + check.stderr


def test_a_named_collector_that_cannot_collect_exits_1_with_one_line(tmp_path):
    result = stagetrace("collect", "--collectors", "rdma", "--sysfs", str(tmp_path))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"stagetrace: collector rdma: {tmp_path}/class/infiniband does not exist: "
        "no RDMA device or driver on this host (--sysfs sets the sysfs root)"
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["collect", "--collectors", "rdma,infiniband"],
            r"stagetrace: unknown collector infiniband: choose from .*rdma",
        ),
        (
            ["agent", "--interval", "5"],
            r"stagetrace agent: --interval: '5' is not a positive duration: write e\.g\. 500ms",
        ),
        (["agent", "--listen", "9464"], r"stagetrace agent: listen address '9464' is not HOST:PORT"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, message):
    result = stagetrace(*args)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and re.fullmatch(message + ".*", result.stderr.strip()), (
        result.stderr
    )


def test_a_taken_listen_address_exits_2_with_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = "127.0.0.1:%d" % taken.getsockname()[1]
        result = stagetrace(
            "agent",
            "--collectors",
            "rdma",
            "--sysfs",
            str(SYSFS),
            "--listen",
            address,
            "--store",
            f"chdb://{tmp_path / 'store'}",
        )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"stagetrace agent: cannot listen on {address}: Address already in use (choose another with --listen)"
    ]


def test_every_taken_address_is_named_in_one_line_at_the_first_start(tmp_path):
    """Four listeners, two of their ports taken: one start says both, not one start per port."""
    with socket.socket() as one, socket.socket() as two:
        for taken in (one, two):
            taken.bind(("127.0.0.1", 0))
            taken.listen()
        metrics, otlp = ("127.0.0.1:%d" % s.getsockname()[1] for s in (one, two))
        result = stagetrace(
            "agent",
            "--collectors",
            "rdma",
            "--sysfs",
            str(SYSFS),
            "--listen",
            metrics,
            "--otlp",
            otlp,
            "--otlp-grpc",
            "127.0.0.1:0",
            "--query-listen",
            "127.0.0.1:0",
            "--store",
            f"chdb://{tmp_path / 'store'}",
        )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"stagetrace agent: cannot listen on {metrics} (--listen: Address already in use), {otlp} (--otlp: Address "
        "already in use): choose other addresses with those options (or none for the receivers and the query endpoint)"
    ]


def start_agent(tmp_path) -> tuple[subprocess.Popen, str]:
    """A running agent on a free loopback port, and its /metrics URL from its own log line."""
    log = tmp_path / "agent.log"
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stagetrace",
            "agent",
            "--collectors",
            "rdma",
            "--sysfs",
            str(SYSFS),
            "--store",
            f"chdb://{tmp_path / 'store'}",
            "--listen",
            "127.0.0.1:0",
            "--interval",
            "500ms",
            "--otlp",
            "none",
            "--otlp-grpc",
            "none",
            "--query-listen",
            "none",
        ],
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        env=ENV,
    )
    url = wait_for(
        "the agent's 'serving' line", lambda: re.search(r"serving (http://\S+/metrics)", log.read_text()), process=agent
    )[1]
    return agent, url


def test_the_agent_receives_otlp_grpc_on_loopback_and_stores_it_before_exiting(tmp_path):
    assert build_parser().parse_args(["agent"]).otlp_grpc == "127.0.0.1:4317"  # the SDKs' port, loopback only
    log = tmp_path / "agent.log"
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stagetrace",
            "agent",
            "--collectors",
            "rdma",
            "--sysfs",
            str(SYSFS),
            "--store",
            f"chdb://{tmp_path / 'store'}",
            "--listen",
            "127.0.0.1:0",
            "--interval",
            "500ms",
            "--otlp",
            "off",
            "--otlp-grpc",
            "127.0.0.1:0",
            "--query-listen",
            "none",
        ],
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        env=ENV,
    )
    try:
        target = wait_for(
            "the agent's OTLP/gRPC line",
            lambda: re.search(r"receiving OTLP/gRPC at (127\.0\.0\.1:\d+) ", log.read_text()),
            process=agent,
        )[1]
        provider = TracerProvider(resource=Resource.create({"service.name": "rag-api"}))
        exporter = OTLPSpanExporter(
            endpoint=f"http://{target}", insecure=True, compression=Compression.Gzip, timeout=10
        )
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        with provider.get_tracer("app").start_as_current_span(
            "request", attributes={"stagetrace.request.id": "grpc-1"}
        ):
            with provider.get_tracer("app").start_as_current_span("decode", attributes={"stagetrace.stage": "decode"}):
                pass
        provider.shutdown()
    finally:
        agent.send_signal(signal.SIGTERM)
        returncode = agent.wait(timeout=60)
    text = log.read_text()
    assert returncode == 0 and "Traceback" not in text and "receiving OTLP/HTTP" not in text, text
    with open_store(f"chdb://{tmp_path / 'store'}") as store:
        assert store.client.query("SELECT RequestId, ServiceName FROM stagetrace.stagetrace_requests").result_rows == [
            ("grpc-1", "rag-api")
        ]
        assert store.client.command("SELECT count() FROM stagetrace.otel_traces") == 2


def start_prometheus(component, tmp_path, target: str) -> tuple[subprocess.Popen, str]:
    binary = component("prometheus", package="prometheus")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs:\n  - job_name: stagetrace\n    static_configs: [{{targets: ['{target}']}}]\n"
    )
    address = f"127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address={address}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "prometheus.log").open("w"),
    )
    return process, f"http://{address}"


def query(api: str, promql: str) -> list:
    answer = get_json(f"{api}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
    return answer["data"]["result"] if answer.get("status") == "success" else []


def test_prometheus_scrapes_the_agent_and_sigterm_leaves_the_samples_in_the_store(component, tmp_path):
    agent, url = start_agent(tmp_path)
    prometheus = None
    try:
        target = urllib.parse.urlsplit(url).netloc
        prometheus, api = start_prometheus(component, tmp_path, target)
        promql = 'rdma_port_transmit_bytes_total{job="stagetrace",device="mlx5_3",port="1"}'
        (series,) = wait_for(f"{promql} in Prometheus", lambda: query(api, promql), process=prometheus)
        assert series["metric"]["host"] == "node-a" and series["metric"]["instance"] == target
        assert float(series["value"][1]) == 4 * TRANSMIT_WORDS
        assert len(query(api, 'rdma_port_state{job="stagetrace"} == 4')) == 8
        assert query(api, 'stagetrace_collector_success{job="stagetrace",collector="rdma"}')[0]["value"][1] == "1"
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=30)
        agent.send_signal(signal.SIGTERM)
        returncode = agent.wait(timeout=60)
    log = (tmp_path / "agent.log").read_text()
    assert returncode == 0, log
    assert "Traceback" not in log and "stopping" in log and "OTLP" not in log  # --otlp none --otlp-grpc none
    with open_store(f"chdb://{tmp_path / 'store'}") as store:
        rows = store.client.query(
            "SELECT Value, IsMonotonic, ResourceAttributes['host.name'] FROM stagetrace.otel_metrics_sum "
            "WHERE MetricName = {name:String} AND Attributes['device'] = 'mlx5_3'",
            parameters={"name": "rdma_port_transmit_bytes_total"},
        ).result_rows
    assert rows and set(rows) == {(4 * TRANSMIT_WORDS, True, "node-a")}


def test_an_agent_writing_to_a_server_store_loads_no_engine_and_no_dataframe_library(tmp_path):
    """With a server store the agent is a small process: no embedded engine, and none of the pandas, NumPy and
    pyarrow that clickhouse-connect would import to check its inserts. The server is ClickHouse's HTTP interface
    answered by the embedded engine in a process of its own (``benchmarks.clickhouse_http``; no ClickHouse server
    runs here), which the agent's real HTTP client writes to."""
    from tests.agents import server_store

    log = tmp_path / "agent.log"
    with server_store(tmp_path / "server") as port:
        dsn = f"http://default:@127.0.0.1:{port}/stagetrace"
        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "stagetrace",
                "agent",
                "--collectors",
                "rdma",
                "--sysfs",
                str(SYSFS),
                "--store",
                dsn,
                "--listen",
                "127.0.0.1:0",
                "--interval",
                "500ms",
                "--otlp",
                "none",
                "--otlp-grpc",
                "none",
                "--query-listen",
                "none",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log.open("w"),
            env={**ENV, "STAGETRACE_SPOOL_DIR": str(tmp_path / "spool")},
        )
        try:
            wait_for("the agent's 'serving' line", lambda: "serving" in log.read_text(), process=agent)  # schema made
            with open_store(dsn, create_schema=False) as store:
                query = (
                    "SELECT count() FROM stagetrace.otel_metrics_sum "
                    "WHERE MetricName = 'rdma_port_transmit_bytes_total'"
                )
                wait_for(
                    "the agent's samples in the server store", lambda: store.client.command(query) >= 8, process=agent
                )
            libraries = Path(f"/proc/{agent.pid}/maps").read_text()
            for library in ("libchdb", "/pandas/", "/numpy/", "/pyarrow/"):
                assert library not in libraries, f"the agent loaded {library}"
        finally:
            agent.terminate()
            agent.wait(timeout=30)


def test_demo_on_a_store_an_agent_holds_says_so_first(tmp_path):
    """The demo writes: on a store a running agent holds it says so at once, not after asking for --fresh."""
    from tests.agents import Agent

    agent = Agent(tmp_path)
    try:
        for extra in ((), ("--fresh",)):
            result = stagetrace("demo", "--requests", "20", "--store", agent.dsn, *extra)
            assert result.returncode != 0 and len(result.stderr.strip().splitlines()) == 1, result.stderr
            assert "is held by the stagetrace agent" in result.stderr and "send spans over OTLP" in result.stderr
    finally:
        agent.stop()
