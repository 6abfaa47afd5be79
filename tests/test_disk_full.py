"""Storage faults: a full disk under the agent's store and spool takes no acknowledged span with it.

A real ``stagetrace agent`` keeps its embedded store and its spool on a small filesystem the test mounts (a tmpfs
of ``SIZE_MIB``: mounting needs root, which CI has; elsewhere the test skips with the reason, and under
``CI=true`` it fails). Three senders post OTLP/HTTP protobuf without pause; another process fills the disk to its
last byte, keeps it full, then frees it; five times, the agent killed with ``kill -9`` in one of them. Then:
the agent refused before the disk was full (its reserve, ``--min-free-space``), every span it answered 200 for
is in the store exactly once after a restart, and its log holds a few lines per episode, not one per request.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from tests.agents import ENV, SYSFS, free_port, mounted_tmpfs, spooled
from tests.test_agent import wait_for

from stagetrace.store import open_store

SIZE_MIB = 256
RESERVE_MIB = 48
# the other process's pace: at once to 16 MiB above the reserve, then 24 MiB/s, so that the reserve lasts it two
# seconds whoever runs beside the test
FILL_MIB_PER_S = 24
EPISODES = 5
KILLED_IN = 2  # the episode in which the agent is killed with kill -9 while the disk is full
FULL_FOR_S = 3.0
SPANS_PER_REQUEST = 20

# what each start and stop of the agent says, not the episodes
STARTS_AND_STOPS = (
    "serving http",
    "running at low priority",
    "refusing writes while free space",
    "receiving OTLP",
    "analysing divergences",
    "stopping",
    "wait in the spool",
    "from an earlier run; replaying",
)

_FILLER = r"""
import os, sys, time
path, rate, slow_below = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
chunk = b"\0" * (1 << 20)
with open(path, "wb", buffering=0) as out:
    try:
        while True:
            out.write(chunk)
            stats = os.statvfs(path)
            if stats.f_bavail * stats.f_frsize < slow_below:
                time.sleep(1 / rate)
    except OSError as exc:
        print(f"full {time.time():.6f} {exc.strerror}", flush=True)
sys.stdin.readline()
os.unlink(path)
print("freed", flush=True)
"""


@pytest.fixture
def small_fs(tmp_path):
    """A tmpfs of SIZE_MIB mounted for the test."""
    with mounted_tmpfs(tmp_path / "small", SIZE_MIB) as mounted:
        yield mounted


class Agent:
    """``stagetrace agent`` with its store (and the spool beside it) on ``disk``, its log outside it, on fixed
    ports so that the senders keep their endpoint across a kill and a restart."""

    def __init__(self, disk: Path, logs: Path, reserve: str | None = f"{RESERVE_MIB}MiB"):
        self.store, self.logs = disk / "store", logs
        self.reserve = reserve  # None: the agent's default
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1/traces"
        self.process: subprocess.Popen | None = None
        self.starts = 0

    @property
    def log(self) -> Path:
        return self.logs / f"agent-{self.starts}.log"

    def start(self) -> None:
        self.starts += 1
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
                f"chdb://{self.store}",
                "--listen",
                "127.0.0.1:0",
                "--interval",
                "1s",
                "--otlp",
                f"127.0.0.1:{self.port}",
                "--otlp-grpc",
                "none",
                "--query-listen",
                "none",
                *(["--min-free-space", self.reserve] if self.reserve else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("w"),
            env=ENV,
        )
        wait_for(
            "the agent's OTLP line",
            lambda: "receiving OTLP/HTTP" in self.log.read_text(),
            timeout=60,
            process=self.process,
        )

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(timeout=60) == 0, self.log.read_text()

    def lines(self) -> list[str]:
        logs = [self.logs / f"agent-{n}.log" for n in range(1, self.starts + 1)]
        return [line for log in logs for line in log.read_text().splitlines()]


class Sender(threading.Thread):
    """Posts requests of new spans, one after another; a request refused (503) or unanswered (the agent killed)
    is sent again, the same body, until it is answered 200, and only then are its spans acknowledged."""

    def __init__(self, n: int, url: str, stop: threading.Event):
        super().__init__(name=f"sender-{n}", daemon=True)
        self.n, self.url, self.stop = n, url, stop
        self.acknowledged: list[str] = []
        self.refusals: list[float] = []  # when each 503 came
        self.failures = 0  # unanswered: connection refused or reset
        self.errors: list[str] = []

    def body(self, k: int) -> tuple[bytes, list[str]]:
        request = ExportTraceServiceRequest()
        scope = request.resource_spans.add().scope_spans.add()
        now = time.time_ns()
        ids = []
        for i in range(SPANS_PER_REQUEST):
            span_id = ((self.n + 1) << 56) | (k * SPANS_PER_REQUEST + i + 1)
            span = scope.spans.add(
                name="disk-full",
                trace_id=((self.n + 1) << 64 | (k + 1)).to_bytes(16, "big"),
                span_id=span_id.to_bytes(8, "big"),
                start_time_unix_nano=now,
                end_time_unix_nano=now + 1000,
            )
            span.attributes.add(key="payload", value={"string_value": os.urandom(24).hex()})
            ids.append(f"{span_id:016x}")
        return request.SerializeToString(), ids

    def run(self) -> None:
        k = 0
        while not self.stop.is_set():
            body, ids = self.body(k)
            while not self.stop.is_set():
                post = urllib.request.Request(
                    self.url, data=body, method="POST", headers={"Content-Type": "application/x-protobuf"}
                )
                try:
                    with urllib.request.urlopen(post, timeout=30) as answer:
                        answer.read()
                    self.acknowledged += ids
                    break
                except urllib.error.HTTPError as exc:
                    if exc.code != 503 or not exc.headers.get("Retry-After"):
                        self.errors.append(f"{exc.code}: {exc.read()[:200]!r}")
                    self.refusals.append(time.time())
                except OSError:
                    self.failures += 1
                time.sleep(0.05)  # an impatient sender: it retries well before Retry-After says
            k += 1
            time.sleep(0.02)


def assert_stored_once(store: Path, senders, at_least: int, log: str) -> None:
    """Every span the senders had acknowledged is in the store exactly once, and no span twice (not even one sent
    but never acknowledged); ``at_least`` acknowledged, so that the episode had traffic to lose."""
    with open_store(f"chdb://{store}") as opened:
        counts = dict(
            opened.client.query(
                "SELECT lower(SpanId), count() FROM stagetrace.otel_traces WHERE SpanName = 'disk-full' GROUP BY SpanId"
            ).result_rows
        )
    acknowledged = [span_id for sender in senders for span_id in sender.acknowledged]
    assert len(acknowledged) > at_least
    missing = [span_id for span_id in acknowledged if span_id not in counts]
    assert not missing, f"{len(missing)} acknowledged spans are not in the store, e.g. {missing[:5]}\n{log}"
    assert {span_id: counts[span_id] for span_id in acknowledged} == dict.fromkeys(acknowledged, 1)
    assert set(counts.values()) == {1}, {k: v for k, v in counts.items() if v > 1}


def test_a_full_disk_five_times_refuses_early_logs_little_and_loses_no_acknowledged_span(small_fs, tmp_path):
    agent = Agent(small_fs, tmp_path)
    agent.start()
    stop = threading.Event()
    senders = [Sender(n, agent.url, stop) for n in range(3)]
    for sender in senders:
        sender.start()
    episodes = []
    try:
        wait_for("the first acknowledgements", lambda: all(s.acknowledged for s in senders), timeout=30)
        for episode in range(EPISODES):
            time.sleep(1.0)
            began = time.time()
            filler = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _FILLER,
                    str(small_fs / "filler"),
                    str(FILL_MIB_PER_S),
                    str((RESERVE_MIB + 16) << 20),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            line = filler.stdout.readline().split()
            assert line and line[0] == "full", line
            full_at = float(line[1])
            time.sleep(FULL_FOR_S)
            if episode == KILLED_IN:
                agent.kill()
            filler.stdin.write("\n")
            filler.stdin.flush()
            assert filler.stdout.readline().strip() == "freed"
            filler.wait(timeout=10)
            freed = sum(len(s.acknowledged) for s in senders)
            if episode == KILLED_IN:
                agent.start()
            again = freed + 30 * SPANS_PER_REQUEST  # thirty requests answered 200 after the disk was freed
            wait_for("acknowledgements again", lambda: sum(len(s.acknowledged) for s in senders) > again, timeout=60)
            refused = sorted(t for s in senders for t in s.refusals if t >= began)
            episodes.append(
                {
                    "refused": len(refused),
                    "first_refusal": refused[0] if refused else None,
                    "full_at": full_at,
                    "began": began,
                }
            )
    finally:
        stop.set()
        for sender in senders:
            sender.join(timeout=60)
    agent.stop()
    agent.start()  # after a restart, as an operator's next day begins
    wait_for("the spool to drain", lambda: not spooled(agent.store), timeout=60)
    agent.stop()
    lines = agent.lines()
    log = "\n".join(lines)
    assert "Traceback" not in log, log
    assert not [e for s in senders for e in s.errors], [e for s in senders for e in s.errors]

    for n, episode in enumerate(episodes):
        # refusals began while the disk still had room: the reserve, not ENOSPC
        assert episode["first_refusal"] is not None and episode["first_refusal"] < episode["full_at"], (n, episode)
        assert episode["refused"] >= 20, (n, episode)

    # a few lines per episode: the state changes, never a line per refused request
    refused = sum(e["refused"] for e in episodes)
    assert log.count("disk full (") <= 2 * EPISODES and log.count("space back after") <= 2 * EPISODES, log
    assert "cannot write a request" not in log and "refusing a request" not in log, log
    episode_lines = [line for line in lines if not any(said in line for said in STARTS_AND_STOPS)]
    assert len(episode_lines) <= 12 * EPISODES and refused > 10 * len(episode_lines), (refused, log)

    assert_stored_once(agent.store, senders, 3000, log)
