"""Agent footprint: CPU share and resident memory of ``stagetrace agent`` at a 1 s interval over the fixture node.

The agent runs as its own process with the fixture node's collectors (gpu, mps, rdma, ethtool), writing
every second into an embedded store in a temporary directory, serving ``/metrics`` on a free port, with
the OTLP receiver and the query endpoint off. Once ``/metrics`` answers and two more intervals have
passed, its user + system CPU time (``/proc/<pid>/stat``) is read at both ends of the window, and its
``VmRSS`` (``/proc/<pid>/status``) every second; ``VmHWM`` is the peak since start, start-up included.
Then the same with a server store: ClickHouse's HTTP interface on a free port, answered by the engine in a
process of its own (``benchmarks.clickhouse_http``: no ClickHouse server runs here), so the agent loads
clickhouse-connect's HTTP client and never the engine. Aims (issue 18): at most 2% of a core; at most 200 MB
with the embedded store, 60 MB with a server store.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks import Figure, benchmark
from stagetrace.store import open_store

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "node"
TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    # the command may hold spaces and parentheses: fields count from the last ')'
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14 and 15 of stat)


def _status_mb(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"no {key} in /proc/{pid}/status")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _measure(store: str, seconds: int, directory: str) -> dict:
    """Run the agent over the fixture node into ``store`` and measure it (see the module docstring)."""
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "stagetrace",
        "agent",
        "--store",
        store,
        "--collectors",
        "gpu,mps,rdma,ethtool",
        "--sysfs",
        str(FIXTURE / "sys"),
        "--nvml-fixture",
        str(FIXTURE / "nvml"),
        "--mps-fixture",
        str(FIXTURE / "mps"),
        "--ethtool-fixture",
        str(FIXTURE / "ethtool" / "statistics.json"),
        "--interval",
        "1s",
        "--listen",
        f"127.0.0.1:{port}",
        "--otlp",
        "none",
        "--otlp-grpc",
        "none",
        "--query-listen",
        "none",
    ]
    log = Path(directory, "agent.log")
    with log.open("w") as stderr:
        agent = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env={**os.environ, "STAGETRACE_SPOOL_DIR": f"{directory}/spool"},
        )
    try:
        started = time.monotonic()
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                    if b"gpu_" in response.read():
                        break
            except OSError:
                pass
            if agent.poll() is not None or time.monotonic() - started > 60:
                raise RuntimeError(f"the agent did not start: {log.read_text()[-500:]}")
            time.sleep(0.2)
        ready = time.monotonic() - started
        time.sleep(2)  # two intervals: the first writes create the store's parts
        cpu0, t0 = _cpu_seconds(agent.pid), time.monotonic()
        rss, anon = [], []
        while time.monotonic() - t0 < seconds:
            time.sleep(1)
            rss.append(_status_mb(agent.pid, "VmRSS"))
            anon.append(_status_mb(agent.pid, "RssAnon"))
        cpu1, t1 = _cpu_seconds(agent.pid), time.monotonic()
        peak = _status_mb(agent.pid, "VmHWM")
        if agent.poll() is not None:
            raise RuntimeError(f"the agent exited: {log.read_text()[-500:]}")
    finally:
        agent.terminate()
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
    return {
        "cpu": (cpu1 - cpu0) / (t1 - t0) * 100,
        "rss": max(rss),
        "anon": max(anon),
        "peak": peak,
        "ready": ready,
        "window": seconds + ready + 2,
    }


def _written(store) -> tuple[int, int]:
    """Rows the agent wrote, and how many distinct sample times they have."""
    return store.client.query(
        "SELECT count(), uniqExact(TimeUnix) FROM (SELECT TimeUnix FROM {db:Identifier}.otel_metrics_gauge "
        "UNION ALL SELECT TimeUnix FROM {db:Identifier}.otel_metrics_sum)",
        parameters={"db": store.database},
    ).result_rows[0]


@benchmark("footprint")
def footprint(quick: bool) -> list[Figure]:
    seconds = 5 if quick else 60
    with tempfile.TemporaryDirectory(prefix="stagetrace-bench-") as directory:
        embedded = _measure(f"chdb://{directory}/store", seconds, directory)
        with open_store(f"chdb://{directory}/store", create_schema=False) as store:
            rows, intervals = _written(store)
        if intervals < seconds:
            raise RuntimeError(f"the agent wrote {intervals} samples in {embedded['window']:.0f} s")
        # a server store: ClickHouse's HTTP interface, answered by the engine in a process of its own
        port = _free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.clickhouse_http", f"{directory}/server", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            dsn = f"http://default:@127.0.0.1:{port}/stagetrace"
            _wait_for(f"http://127.0.0.1:{port}/ping", server)
            remote = _measure(dsn, seconds, directory)
            with open_store(dsn, create_schema=False) as store:
                _, remote_intervals = _written(store)
        finally:
            server.terminate()
            server.wait(timeout=30)
        if remote_intervals < seconds:
            raise RuntimeError(
                f"the agent wrote {remote_intervals} samples to the server store in {remote['window']:.0f} s"
            )
    return [
        Figure(
            f"agent CPU, 1 s interval, 4 collectors, {seconds} s window, embedded store",
            embedded["cpu"],
            "% of a core",
            "aim",
            2.0,
        ),
        Figure(
            "agent resident memory (VmRSS), largest in the window, embedded store", embedded["rss"], "MB", "aim", 200.0
        ),
        Figure("agent peak resident memory since start (VmHWM), embedded store", embedded["peak"], "MB", "aim", 200.0),
        Figure(
            "agent private memory (RssAnon: VmRSS less the engine library's file-backed pages), embedded store",
            embedded["anon"],
            "MB",
            "aim",
            200.0,
        ),
        Figure(
            f"agent CPU, 1 s interval, 4 collectors, {seconds} s window, server store (HTTP)",
            remote["cpu"],
            "% of a core",
            "aim",
            2.0,
        ),
        Figure(
            "agent resident memory (VmRSS), largest in the window, server store (HTTP)",
            remote["rss"],
            "MB",
            "aim",
            60.0,
        ),
        Figure(
            "agent peak resident memory since start (VmHWM), server store (HTTP)", remote["peak"], "MB", "aim", 60.0
        ),
        Figure("agent start-up until /metrics answers, embedded store", embedded["ready"], "s"),
        Figure("agent start-up until /metrics answers, server store (HTTP)", remote["ready"], "s"),
        Figure("metric samples the agent wrote per interval", rows / intervals, "rows"),
    ]


def _wait_for(url: str, process: subprocess.Popen, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer") from None
            time.sleep(0.2)
