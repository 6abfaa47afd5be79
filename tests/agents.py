"""A real `stagetrace agent` process for tests, and the CLI run as another process would run it."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSFS = Path(__file__).parent / "fixtures" / "node" / "sys"
BASE_ENV = {k: v for k, v in os.environ.items() if not k.startswith("STAGETRACE_AGENT_TOKEN")}
ENV = {**BASE_ENV, "STAGETRACE_HOST": "node-a", "COLUMNS": "200"}


class Agent:
    """A running `stagetrace agent` and the endpoints it advertises in ``<store>/agent.json``."""

    def __init__(self, directory: Path, *extra: str, env: dict | None = None):
        directory.mkdir(parents=True, exist_ok=True)
        self.store = directory / "store"
        self.dsn = f"chdb://{self.store}"
        self.log = directory / "agent.log"
        self.process = subprocess.Popen(
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
                self.dsn,
                "--listen",
                "127.0.0.1:0",
                "--otlp",
                "127.0.0.1:0",
                "--otlp-grpc",
                "127.0.0.1:0",
                "--query-listen",
                "127.0.0.1:0",
                "--interval",
                "1s",
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("w"),
            env={**ENV, **(env or {})},
        )
        deadline = time.monotonic() + 60
        while not (self.store / "agent.json").exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the agent did not start: {self.log.read_text()}")
            time.sleep(0.2)
        self.endpoints = json.loads((self.store / "agent.json").read_text())
        self.query_port = urllib.parse.urlsplit(self.endpoints["query"]).port

    def stop(self) -> str:
        self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(timeout=60) == 0, self.log.read_text()
        log = self.log.read_text()
        assert "Traceback" not in log, log
        return log


def unavailable(message: str):
    """A real component the test needs is missing: under ``CI=true`` the run fails, elsewhere the test skips."""
    import pytest

    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@contextmanager
def mounted_tmpfs(where: Path, size_mib: int):
    """A tmpfs of ``size_mib`` mounted at ``where`` (made) for the length of the block; mounting needs root."""
    import shutil

    if os.geteuid() != 0 or not shutil.which("mount"):
        unavailable("mounting a small filesystem for the store needs root and mount(8)")
    where.mkdir(parents=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        unavailable(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def spooled(store: Path) -> list[Path]:
    """What waits in the spool beside an embedded store: batches (``.seg``) and write-ahead records (``.wal``),
    not the stored records it keeps (``.kept``)."""
    return sorted(p for p in Path(f"{store}.spool").rglob("*") if p.suffix in (".wal", ".seg"))


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server_store(path: Path, port: int) -> subprocess.Popen:
    """A server store: ClickHouse's HTTP interface answered by the embedded engine at ``path`` in a process of its
    own (``benchmarks.clickhouse_http``; no ClickHouse server runs here) on ``port``, once it answers; what it
    writes to stderr goes to ``<path>.log``."""
    log = path.with_name(path.name + ".log")
    server = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.clickhouse_http", str(path), str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=log.open("a"),
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2)
            return server
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)


@contextmanager
def server_store(path: Path):
    """:func:`start_server_store` on a free port, for the ``with`` block; yields the port."""
    port = free_port()
    server = start_server_store(path, port)
    try:
        yield port
    finally:
        server.kill()
        server.wait(timeout=30)


def stagetrace(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stagetrace", *args],
        capture_output=True,
        text=True,
        env={**ENV, **(env or {})},
        timeout=120,
    )
