"""Durability soak: ``stagetrace agent`` under steady OTLP load through a store outage and three ``kill -9``s.

The agent runs as its own process on fixed loopback ports, with its spool on another filesystem than its
store. A sender posts protobuf batches of stage spans at a fixed rate over HTTP and, like the official
exporters, sends a batch again until it is answered 200; only then does it count as acknowledged. During
the run the agent is killed three times (and started again on the same store and ports), and the store's
disk fills up for a while: the store lives on a small tmpfs that a file then fills, so every insert fails
with ENOSPC until the file is removed (a real outage of the embedded engine; without the right to mount a
tmpfs, the run has no outage and says so). At the end the spans in the store are reconciled with the
acknowledgements: every acknowledged span stored, none twice. ``STAGETRACE_DURABILITY_SECONDS`` sets the full
run (default 600 s; quick mode: 24 s).
"""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from benchmarks import Figure, benchmark, median_seconds
from benchmarks.soak import SPANS_PER_BATCH, _batch, _rss_mib
from stagetrace.environment_variables import STAGETRACE_SPOOL_KEEP_BYTES
from stagetrace.exporters import spool
from stagetrace.store import open_store

KILLS = (0.2, 0.45, 0.8)  # moments of the run, as shares of it
OUTAGE = (0.55, 0.7)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Agent:
    def __init__(self, directory: Path, store: Path, spool: Path):
        self.directory, self.store, self.spool = directory, store, spool
        self.otlp, self.metrics = _free_port(), _free_port()
        self.process: subprocess.Popen | None = None
        self.starts = 0
        self.dropped: dict[str, float] = {}  # per reason, summed over the agent's lives (last scrape of each)
        self._last: dict[str, float] = {}

    def start(self) -> None:
        self.starts += 1
        self.dropped = {k: self.dropped.get(k, 0) + v for k, v in self._last.items()}
        self._last = {}
        log = self.directory / f"agent-{self.starts}.log"
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "stagetrace",
                "agent",
                "--store",
                f"chdb://{self.store}",
                "--listen",
                f"127.0.0.1:{self.metrics}",
                "--interval",
                "1s",
                "--otlp",
                f"127.0.0.1:{self.otlp}",
                "--otlp-grpc",
                "none",
                "--query-listen",
                "none",
                "--collectors",
                "",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log.open("w"),
            env={**os.environ, "STAGETRACE_HOST": "bench", "STAGETRACE_SPOOL_DIR": str(self.spool)},
        )
        deadline = time.monotonic() + 60
        while "receiving OTLP/HTTP" not in log.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the agent did not start: {log.read_text()[-500:]}")
            time.sleep(0.1)

    def scrape(self) -> None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=2) as response:
                text = response.read().decode()
        except OSError:
            return
        for family in text_string_to_metric_families(text):
            if family.name == "stagetrace_dropped_spans":
                self._last = {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}

    def totals(self) -> dict[str, float]:
        return {k: self.dropped.get(k, 0) + self._last.get(k, 0) for k in set(self.dropped) | set(self._last)}


class _Sender(threading.Thread):
    """One batch every ``period_s``; a batch is sent again until answered 200 (then acknowledged)."""

    def __init__(self, port: int, period_s: float):
        super().__init__(daemon=True)
        self.port, self.period_s = port, period_s
        self.stop = threading.Event()
        self.acknowledged: list[int] = []  # batch numbers
        self.retries = 0

    def run(self) -> None:
        number, due = 0, time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        while not self.stop.is_set():
            body = _batch(number)
            while not self.stop.is_set():
                try:
                    conn.request("POST", "/v1/traces", body, {"Content-Type": "application/x-protobuf"})
                    response = conn.getresponse()
                    response.read()
                    if response.status == 200:
                        self.acknowledged.append(number)
                        break
                except OSError:
                    conn.close()
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                self.retries += 1
                time.sleep(0.2)
            number += 1
            due += self.period_s
            self.stop.wait(max(0.0, due - time.monotonic()))
        conn.close()


def _mount_small_disk(path: Path) -> bool:
    path.mkdir(parents=True)
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", str(path)], check=True, capture_output=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def _fill(path: Path) -> Path:
    """A file that takes every free byte of ``path``'s filesystem."""
    filler = path / "filler"
    free = shutil.disk_usage(path).free
    with filler.open("wb") as f:
        try:
            chunk = b"\0" * (1 << 20)
            for _ in range(free // len(chunk) + 1):
                f.write(chunk)
        except OSError:
            pass
    return filler


@benchmark("durability")
def durability(quick: bool) -> list[Figure]:
    duration_s = 24.0 if quick else float(os.environ.get("STAGETRACE_DURABILITY_SECONDS", "600"))
    spans_per_s = 1000
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        disk = directory / "disk"
        mounted = _mount_small_disk(disk)
        agent = _Agent(directory, disk / "store", directory / "spool")
        try:
            agent.start()
            sender = _Sender(agent.otlp, SPANS_PER_BATCH / spans_per_s)
            started = time.monotonic()
            sender.start()
            kills, outage_pending, peak, filler = list(KILLS), mounted, 0.0, None
            outage_began = outage_s = 0.0
            while (share := (time.monotonic() - started) / duration_s) < 1.0:
                if kills and share >= kills[0]:
                    kills.pop(0)
                    agent.process.send_signal(signal.SIGKILL)
                    agent.process.wait(timeout=30)
                    agent.start()
                if outage_pending and share >= OUTAGE[0]:
                    outage_pending, outage_began, filler = False, time.monotonic(), _fill(disk)
                if filler is not None and share >= OUTAGE[1]:
                    filler.unlink()
                    filler, outage_s = None, time.monotonic() - outage_began
                peak = max(peak, _rss_mib(agent.process.pid))
                agent.scrape()
                time.sleep(0.5)
            sender.stop.set()
            sender.join(timeout=60)
            acked_s = time.monotonic() - started
            if filler is not None:
                filler.unlink()
            deadline = time.monotonic() + 300  # the spool drains into the store
            while any((directory / "spool").rglob("*.seg")) and time.monotonic() < deadline:
                agent.scrape()
                time.sleep(0.5)
            agent.scrape()
            agent.process.send_signal(signal.SIGTERM)
            if agent.process.wait(timeout=120) != 0:
                raise RuntimeError("the agent did not stop cleanly")
            left = sum(1 for _ in (directory / "spool").rglob("*.seg"))
            failing = sum(log.read_text().count("will retry") for log in directory.glob("agent-*.log"))
            with open_store(f"chdb://{disk / 'store'}") as store:
                counts = dict(
                    store.client.query(
                        "SELECT SpanAttributes['stagetrace.request.id'] AS id, count() FROM stagetrace.otel_traces "
                        "WHERE ServiceName = 'soak' GROUP BY id"
                    ).result_rows
                )
        finally:
            if agent.process is not None and agent.process.poll() is None:
                agent.process.kill()
            if mounted:
                subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=30)
    acknowledged = [f"soak-{n}-{i}" for n in sender.acknowledged for i in range(SPANS_PER_BATCH)]
    taken = set(acknowledged)
    missing = sum(1 for rid in acknowledged if rid not in counts)
    duplicates = sum(n - 1 for n in counts.values() if n > 1)
    dropped = agent.totals()
    figures = [
        Figure(
            f"spans acknowledged (200) over {duration_s:g} s at {spans_per_s} spans/s, {len(KILLS)} kill -9s, "
            + (f"{outage_s:.0f} s disk-full outage" if mounted else "no outage (cannot mount a tmpfs here)"),
            len(acknowledged),
            "spans",
        ),
        Figure("acknowledged spans missing from the store", missing, "spans"),
        Figure("spans stored more than once (extra copies)", duplicates, "spans"),
        Figure("spans stored that were never acknowledged", sum(1 for rid in counts if rid not in taken), "spans"),
        Figure("segments left in the spool after it drained", left, "segments"),
        Figure("times the agent found the store failing (its 'will retry' log lines)", failing, "lines"),
        Figure("requests sent again (no answer, or 503)", sender.retries, "requests"),
        Figure("acknowledged throughput over the run", len(acknowledged) / acked_s, "spans/s"),
        Figure("agent peak RSS", peak, "MiB"),
    ]
    figures += [Figure(f"spans dropped, reason {reason}", dropped.get(reason, 0), "spans") for reason in spool.REASONS]
    return figures


def _ingest(receiver, bodies: list[bytes]) -> float:
    """Seconds to post ``bodies`` to ``receiver`` over one connection, each answered 200, until its spool drained."""
    conn = http.client.HTTPConnection("127.0.0.1", int(receiver.url.rsplit(":", 1)[1]), timeout=60)
    started = time.perf_counter()
    try:
        for body in bodies:
            conn.request("POST", "/v1/traces", body, {"Content-Type": "application/x-protobuf"})
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                raise RuntimeError(f"the receiver answered {response.status}")
        if not receiver.writer.flush(120):
            raise RuntimeError("the spool did not drain")
        return time.perf_counter() - started
    finally:
        conn.close()


@benchmark("reserve")
def reserve(quick: bool) -> list[Figure]:
    """What issue 36's protections cost the write path, in one run: the same OTLP/HTTP requests of 512 spans into
    three receivers on one embedded store, alternating, the clock stopping when every span is in ``otel_traces``:
    as shipped (the default free-space reserve, its cached ``statvfs`` check per request and the engine's insert
    guard; the fsync settings of the store's tables; stored records kept to restore a broken part), the same
    without the reserve, and the write path before any of them (no reserve, tables without the fsync settings, in
    a database of their own, and no records kept). Beside it, the check itself per request against one
    ``statvfs``."""
    import statistics

    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from benchmarks.export import make_spans
    from stagetrace import schema
    from stagetrace.exporters.diskspace import DEFAULT, Headroom
    from stagetrace.exporters.otlp import OtlpReceiver

    requests, rounds = (40, 1) if quick else (400, 4)
    spans = make_spans(requests * 512 // 6 + 1)
    bodies = [encode_spans(spans[i : i + 512]).SerializeToString() for i in range(0, requests * 512, 512)]
    names = ("shipped", "no reserve", "before")
    seconds: dict[str, list[float]] = {name: [] for name in names}
    kept_before = os.environ.pop(STAGETRACE_SPOOL_KEEP_BYTES, None)
    with (
        tempfile.TemporaryDirectory(prefix="stagetrace-bench-") as directory,
        open_store(f"chdb://{directory}/store") as store,
        open_store(f"chdb://{directory}/store?database=before") as before,
    ):
        for table in schema.DURABLE_TABLES:  # the tables as they were: the engine's defaults
            before.client.command(
                f"ALTER TABLE before.`{table}` MODIFY SETTING fsync_after_insert = 0, "
                "fsync_part_directory = 0, min_compressed_bytes_to_fsync_after_merge = 0"
            )
        headroom = Headroom({"store": store.location.path, "spool": directory}, DEFAULT)
        receivers = {
            "shipped": OtlpReceiver(store, "127.0.0.1:0", headroom=headroom, spool_dir=f"{directory}/a"),
            "no reserve": OtlpReceiver(store, "127.0.0.1:0", spool_dir=f"{directory}/b"),
        }
        os.environ[STAGETRACE_SPOOL_KEEP_BYTES] = "0"  # read as the spool opens: none kept
        receivers["before"] = OtlpReceiver(before, "127.0.0.1:0", spool_dir=f"{directory}/c")
        del os.environ[STAGETRACE_SPOOL_KEEP_BYTES]
        try:
            for round_ in range(rounds):
                for name in names[round_ % 3 :] + names[: round_ % 3]:  # each goes first in turn
                    seconds[name].append(_ingest(receivers[name], bodies))
                for db in ("stagetrace", "before"):
                    store.client.command(f"TRUNCATE TABLE {db}.otel_traces")  # the next round's tokens are new
                bodies = [body + b"\x0a\x00" for body in bodies]  # an empty ResourceSpans more: another request
        finally:
            for receiver in receivers.values():
                receiver.close()
            if kept_before is not None:
                os.environ[STAGETRACE_SPOOL_KEEP_BYTES] = kept_before
        n = 200_000 if not quick else 20_000
        started = time.perf_counter()
        for _ in range(n):
            headroom.admit()
        check_ns = (time.perf_counter() - started) / n * 1e9
        started = time.perf_counter()
        for _ in range(n // 10):
            os.statvfs(store.location.path)
        statvfs_ns = (time.perf_counter() - started) / (n // 10) * 1e9
    total = len(bodies) * 512
    rate = {name: total / statistics.median(values) for name, values in seconds.items()}
    before_36 = "the write path before issue 36 (no reserve, no fsync settings, no records kept)"
    return [
        Figure(
            f"OTLP/HTTP ingest of {total:,} spans in 512-span requests, as shipped (reserve {DEFAULT}, fsync "
            "settings, records kept)",
            rate["shipped"],
            "spans/s",
            before_36,
            rate["before"],
        ),
        Figure(
            "the same without the reserve (fsync settings, records kept)",
            rate["no reserve"],
            "spans/s",
            before_36,
            rate["before"],
        ),
        Figure("reserve check per request (statvfs cached for 0.25 s)", check_ns, "ns", "one statvfs", statvfs_ns),
        Figure("reserve check per span (512-span requests)", check_ns / 512, "ns"),
    ]


@benchmark("part_guard")
def part_guard(quick: bool) -> list[Figure]:
    """What issue 50's guard costs the write path, in one run: the same OTLP/HTTP requests of 512 spans into two
    receivers on one embedded store, alternating, the clock stopping when every span is in ``otel_traces``: one
    whose writer has every insert's parts checked before it retires the records (``part_guard``, as the agent
    runs it), one without. Beside it, one round of the guard's check (a ``system.parts`` query) on that store."""
    import statistics

    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from benchmarks.export import make_spans
    from stagetrace.exporters.otlp import OtlpReceiver
    from stagetrace.part_guard import PartGuard

    requests, rounds = (40, 1) if quick else (400, 4)
    spans = make_spans(requests * 512 // 6 + 1)
    bodies = [encode_spans(spans[i : i + 512]).SerializeToString() for i in range(0, requests * 512, 512)]
    names = ("guarded", "unguarded")
    seconds: dict[str, list[float]] = {name: [] for name in names}
    with (
        tempfile.TemporaryDirectory(prefix="stagetrace-bench-") as directory,
        open_store(f"chdb://{directory}/store") as store,
    ):
        guard = PartGuard(store)
        guard.check()  # what is there now: the parts made from here on are checked
        receivers = {
            "guarded": OtlpReceiver(store, "127.0.0.1:0", spool_dir=f"{directory}/a", part_guard=guard),
            "unguarded": OtlpReceiver(store, "127.0.0.1:0", spool_dir=f"{directory}/b"),
        }
        try:
            for round_ in range(rounds * 2):
                for name in names[round_ % 2 :] + names[: round_ % 2]:  # each goes first in turn
                    seconds[name].append(_ingest(receivers[name], bodies))
                    bodies = [body + b"\x0a\x00" for body in bodies]  # an empty ResourceSpans more: new requests
        finally:
            for receiver in receivers.values():
                receiver.close()
        parts = int(store.client.command("SELECT count() FROM system.parts WHERE database = 'stagetrace' AND active"))
        check_s = median_seconds(guard.check, 5 if quick else 50)
    if guard.undone:
        raise RuntimeError(f"the guard found parts short on a disk with room: {guard.undone}")
    total = len(bodies) * 512
    rate = {name: total / statistics.median(values) for name, values in seconds.items()}
    return [
        Figure(
            f"OTLP/HTTP ingest of {total:,} spans in 512-span requests, each insert's parts checked before its "
            "records are retired",
            rate["guarded"],
            "spans/s",
            "the same without the part guard",
            rate["unguarded"],
        ),
        Figure(f"one round of the part guard's check ({parts} active parts)", check_s * 1e3, "ms"),
    ]
