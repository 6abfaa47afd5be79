"""The benchmarks' server store (``benchmarks.clickhouse_http``: ClickHouse's HTTP interface answered by the embedded
engine, as no ClickHouse server runs here) stores every row an insert sends. clickhouse-connect sends an insert
larger than one of its blocks as one compressed frame a block; the stand-in once kept the first frame only, which
the ingest benchmark's read-back found as acknowledged spans missing (issue 32)."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import clickhouse_connect
import pytest

from tests.agents import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def port(tmp_path_factory):
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.clickhouse_http",
                               str(tmp_path_factory.mktemp("server") / "store"), str(port)],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=5)
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "the HTTP interface did not answer"
                time.sleep(0.2)
        yield port
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.parametrize("compress", ["lz4", "zstd", False])
def test_an_insert_of_many_blocks_is_stored_whole(port, compress):
    client = clickhouse_connect.get_client(host="127.0.0.1", port=port, username="default", password="",
                                           compress=compress)  # fmt: skip
    table = f"rows_{compress or 'plain'}"
    client.command(f"CREATE TABLE {table} (n UInt64, text String) ENGINE = MergeTree ORDER BY n")
    rows = [(n, f"row {n} " + "x" * 200) for n in range(100_000)]  # several of the client's blocks
    client.insert(table, rows, column_names=["n", "text"])
    stored = client.query(f"SELECT count(), uniqExact(n), max(n) FROM {table}").result_rows
    assert stored == [(100_000, 100_000, 99_999)]
