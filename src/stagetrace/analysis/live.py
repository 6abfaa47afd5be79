"""The live analyser: divergence analysis as a loop, so the first divergent stage and the cause reach Grafana,
``/metrics`` and the pager without anyone running a command.

Each pass analyses the requests that started since the last pass ended, up to ``settle`` before now (late spans of a
request arrive within it), with the same code as ``stagetrace divergences`` (``divergences.compute``, whose report
it reads by field, and ``divergences.record``). Only the groups of the inputs that arrived since the last pass are
formed, each from the ``lookback`` window before it, in ClickHouse: a pass groups what the new traffic's inputs were
asked in that window, not the whole window, whatever the store's history. Requests of the last ``recheck`` (two
periods) are looked at again each pass, and one whose group's majority changed as more peers arrived (its input
arrived again) is analysed again. ``stagetrace_divergences`` keeps one row per request (ReplacingMergeTree by
request ID): analysed twice, it is one row.

One analyser per store: a lease in ``stagetrace_analyser``, renewed every period by a heartbeat, held for two. A second
analyser waits; it takes over within two periods after the first stops renewing, from where the first's last pass
ended (the table records it), so a restart leaves neither gaps nor duplicate rows. The store has no
compare-and-set, so two analysers that claim at the same moment both read back the newest claim and the older one
yields; at worst both run one pass, whose rows are the same.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

from stagetrace.errors import first_line
from stagetrace.metrics import COUNTER, GAUGE, MetricSpec, Samples
from stagetrace.store import Store

logger = logging.getLogger(__name__)

S = 1_000_000_000
DEFAULT_EVERY_S = 60.0
DEFAULT_SETTLE_S = 10.0  # as the TP rule leaves out the newest 10 s for late spans
DEFAULT_LOOKBACK_S = 3600.0  # same-input peers: as `stagetrace divergences --since 1h`
MAX_SPAN_PERIODS = 10  # with the lookback, bounds the requests one pass analyses: a backlog is caught up in steps

_LEASE_SQL = """
SELECT Holder, toUnixTimestamp64Milli(Expires), toUnixTimestamp64Nano(AnalysedUntil)
FROM {db:Identifier}.stagetrace_analyser ORDER BY Renewed DESC, Holder DESC LIMIT 1"""
_LATEST_REQUEST_SQL = """
SELECT toUnixTimestamp64Nano(max(Start)) FROM {db:Identifier}.stagetrace_requests
WHERE Start >= fromUnixTimestamp64Nano({t0:Int64}) AND Start <= fromUnixTimestamp64Nano({t1:Int64})"""
_LEASE_COLUMNS = ("Holder", "Renewed", "Expires", "AnalysedUntil")


@dataclass(frozen=True)
class Schedule:
    """When the analyser runs and what each pass reads; every field has a flag and an environment variable."""

    every_s: float = DEFAULT_EVERY_S
    settle_s: float = DEFAULT_SETTLE_S
    lookback_s: float = DEFAULT_LOOKBACK_S
    recheck_s: float | None = None  # requests this recent are analysed again each pass (None: two periods)

    def __post_init__(self):
        if self.recheck_s is None:
            object.__setattr__(self, "recheck_s", 2 * self.every_s)
        if self.every_s <= 0 or self.settle_s < 0 or self.lookback_s <= 0 or self.recheck_s < 0:
            raise ValueError("the analyser's period and lookback must be positive, its settle and recheck not negative")


@dataclass
class Pass:
    """What one pass did."""

    until_ns: int  # requests that started before this were analysed
    analysed: int  # deviating requests analysed (new and re-checked)
    new: dict[
        tuple[str, str, str], int
    ]  # (service, stage, top cause) -> deviating requests recorded for the first time
    duration_s: float
    # (service, stage, rank, GPU, its host) -> of those, the requests whose difference that TP rank began
    began: dict[tuple[str, str, str, str, str], int] = field(default_factory=dict)


# what the analyser exposes on /metrics (the agent's, or `stagetrace analyse --listen`), described as data
DEVIATING = MetricSpec(
    "stagetrace_deviating_requests_total",
    COUNTER,
    "Deviating requests the live analyser recorded, by service, first divergent stage and top "
    "cause (its name: values stay out of labels).",
    ("service", "stage", "cause"),
)
# One series per GPU that began differences (a TP rank's contribution, or inside the stage on it), never per request:
# as many as the GPUs that went wrong. Its host is ``gpu_host``: ``host`` is the analyser's own, on every series.
BEGAN = MetricSpec(
    "stagetrace_deviations_began_total",
    COUNTER,
    "Deviating requests the live analyser recorded whose difference a TP rank began, by service, "
    "first divergent stage, that rank, its GPU and the GPU's host (gpu_host).",
    ("service", "stage", "rank", "gpu", "gpu_host"),
)
ANALYSED = MetricSpec(
    "stagetrace_analysed_requests_total", COUNTER, "Deviating requests the live analyser analysed, re-checks included."
)
PASSES = MetricSpec("stagetrace_analysis_passes_total", COUNTER, "Analysis passes that completed.")
FAILURES = MetricSpec(
    "stagetrace_analysis_failures_total",
    COUNTER,
    "Passes that failed (the store unreachable, a query refused); the next period retries.",
)
DURATION = MetricSpec("stagetrace_analysis_duration_seconds", GAUGE, "How long the last pass took.", unit="seconds")
LAG = MetricSpec(
    "stagetrace_analysis_lag_seconds",
    GAUGE,
    "How far behind the newest request the last pass "
    "reached (the settle delay and the pass itself at best); it grows while passes fail.",
    unit="seconds",
)
HOLDING = MetricSpec(
    "stagetrace_analyser_holding_lease",
    GAUGE,
    "1 when this process is the store's analyser, 0 while another holds the lease.",
)


class Stats:
    """The analyser's counters, as metric families at scrape time."""

    def __init__(self):
        self._lock = threading.Lock()
        self.deviating: dict[tuple[str, str, str], int] = {}
        self.began: dict[tuple[str, str, str, str, str], int] = {}
        self.analysed = self.passes = self.failures = 0
        self.duration_s = self.lag_s = 0.0
        self.holding = False

    def record(self, done: Pass, lag_s: float) -> None:
        with self._lock:
            for key, n in done.new.items():
                self.deviating[key] = self.deviating.get(key, 0) + n
            for key, n in done.began.items():
                self.began[key] = self.began.get(key, 0) + n
            self.analysed += done.analysed
            self.passes += 1
            self.duration_s = done.duration_s
            self.lag_s = lag_s

    def failed(self, lag_s: float) -> None:
        with self._lock:
            self.failures += 1
            self.lag_s = lag_s

    def families(self, host: str):
        out = Samples()
        with self._lock:
            for key, n in sorted(self.deviating.items()):
                out.add_series(DEVIATING, key, n)
            for key, n in sorted(self.began.items()):
                out.add_series(BEGAN, key, n)
            for spec, value in (
                (ANALYSED, self.analysed),
                (PASSES, self.passes),
                (FAILURES, self.failures),
                (DURATION, self.duration_s),
                (LAG, self.lag_s),
                (HOLDING, float(self.holding)),
            ):
                out.add_series(spec, (), value)
        return out.families(host)


class Lease:
    """The rows of ``stagetrace_analyser`` one analyser reads and writes: who holds the lease, until when, and where
    its analysis reached."""

    def __init__(self, store: Store, holder: str, schedule: Schedule, clock):
        self.store, self.holder, self.schedule, self.clock = store, holder, schedule, clock

    def newest(self) -> tuple[str, int, int] | None:
        """(holder, expires in ms, analysed until in ns) of the newest row."""
        rows = self.store.client.query(_LEASE_SQL, parameters={"db": self.store.database}).result_rows
        return tuple(rows[0]) if rows else None

    def claim(self, analysed_until_ns: int, held: bool = True) -> None:
        now_ms = self.clock() // 1_000_000
        expires_ms = now_ms + int(2 * self.schedule.every_s * 1000) if held else 0
        self.store.client.insert(
            "stagetrace_analyser",
            [(self.holder, now_ms, expires_ms, analysed_until_ns)],
            column_names=_LEASE_COLUMNS,
            database=self.store.database,
        )


class Analyser:
    """The loop over one store. ``clock`` returns nanoseconds since the epoch (tests move it)."""

    def __init__(
        self,
        store: Store,
        schedule: Schedule | None = None,
        holder: str | None = None,
        stats: Stats | None = None,
        clock=time.time_ns,
    ):
        self.store = store
        self.schedule = schedule or Schedule()
        self.holder = holder or f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
        self.stats = stats or Stats()
        self.clock = clock
        self.lease = Lease(store, self.holder, self.schedule, clock)
        # request ID -> where the pass that counted it reached: each is counted once in stagetrace_deviating_requests
        self._counted: dict[str, int] = {}
        self._groups: dict[str, str] = {}  # request ID -> its group's majority output when analysed
        self._cursor = 0  # where the analysis reached: what the heartbeat renews the lease with, the lag counts from
        self._cursor_lock = threading.Lock()
        self._failing = False  # said once per outage

    def acquire(self) -> int | None:
        """Take or renew the lease; where to analyse from (request start, ns) when held, else None."""
        newest = self.lease.newest()
        now_ms = self.clock() // 1_000_000
        if newest is not None and newest[0] != self.holder and newest[1] > now_ms:
            return None  # another analyser holds it
        start = newest[2] if newest is not None and newest[2] > 0 else None
        start = start or self.clock() - int(self.schedule.lookback_s * S)
        with self._cursor_lock:
            self._cursor = start
            self.lease.claim(start)
        newest = self.lease.newest()  # two claims at once: the newest wins, the other yields
        return start if newest is not None and newest[0] == self.holder else None

    def release(self) -> None:
        """Let another analyser take over at once (on a clean stop)."""
        newest = self.lease.newest()
        if newest is not None and newest[0] == self.holder:
            self.lease.claim(newest[2], held=False)

    # -- one pass ------------------------------------------------------------------------------------------------

    def run_pass(self, start_ns: int) -> Pass:
        """Analyse the requests that started in [start_ns - recheck, now - settle) and record how far it got."""
        from stagetrace.analysis import divergences

        started = time.monotonic()
        schedule = self.schedule
        # after an outage or a takeover, a backlog is caught up a bounded span a pass (the lookback, or ten periods)
        span_ns = int(max(MAX_SPAN_PERIODS * schedule.every_s, schedule.lookback_s) * S)
        until_ns = min(self.clock() - int(schedule.settle_s * S), start_ns + span_ns)
        until_ns = max(until_ns, start_ns)
        analyse_from = start_ns - int(schedule.recheck_s * S)

        def changed(d) -> bool:  # a request analysed before is analysed again only if its group's majority changed
            return self._groups.get(d.request_id) != d.majority_output

        report = divergences.compute(
            self.store,
            int(schedule.lookback_s * S) + (until_ns - analyse_from),
            until_ns,
            limit=None,
            analyse_from_ns=analyse_from,
            analyse=changed,
            inputs_from_ns=start_ns,
            tally_all=False,
        )
        divergences.record(self.store, report)
        new: dict[tuple[str, str, str], int] = {}
        began: dict[tuple[str, str, str, str, str], int] = {}
        analysed = 0
        for group in report.groups:
            for item in group.deviating:
                analysed += 1
                self._groups[item.request_id] = group.majority_output
                if item.request_id in self._counted:
                    continue
                self._counted[item.request_id] = until_ns
                key = (item.service, item.stage or "", item.top.name if item.top else "")
                new[key] = new.get(key, 0) + 1
                for place in item.began():  # as stored: one entry per beginning rank
                    began[key[:2] + place] = began.get(key[:2] + place, 0) + 1
        horizon = analyse_from - int(schedule.recheck_s * S)  # forget what can no longer be re-checked
        self._counted = {k: v for k, v in self._counted.items() if v >= horizon}
        self._groups = {k: v for k, v in self._groups.items() if k in self._counted}
        newest = self.lease.newest()
        if newest is None or newest[0] != self.holder:
            raise RuntimeError("another analyser took the lease during the pass")
        with self._cursor_lock:
            self._cursor = until_ns
            self.lease.claim(until_ns)
        return Pass(until_ns, analysed, new, time.monotonic() - started, began)

    def lag_s(self, reached_ns: int) -> float:
        """Seconds between the newest request (a host's clock ahead of ours counts as now) and where the analysis
        reached: the requests still settling and those that arrived during the pass; 0 when none arrived since."""
        now = self.clock()
        newest = self.store.client.command(
            _LATEST_REQUEST_SQL, parameters={"db": self.store.database, "t0": reached_ns, "t1": now}
        )
        newest = int(newest or 0) or reached_ns
        return max(0.0, (min(newest, now) - reached_ns) / S)

    def step(self) -> Pass | None:
        """One period: the pass when this analyser holds the lease, else None. A failure is counted, logged once
        per outage, and retried the next period."""
        try:
            start = self.acquire()
            self.stats.holding = start is not None
            if start is None:
                return None
            done = self.run_pass(start)
        except Exception as exc:  # the store down, a query refused: say so once, retry next period
            # a failing analyser stops renewing its lease, so that another one can take over
            self.stats.holding = False
            self.stats.failed((self.clock() - self._cursor) / S if self._cursor else 0.0)
            if not self._failing:  # once per outage, not once per period
                logger.warning(
                    "live analysis failed, retrying every %gs: %s",
                    self.schedule.every_s,
                    first_line(exc),
                )
                self._failing = True
            return None
        if self._failing:
            logger.info("live analysis resumed")
            self._failing = False
        try:
            lag = self.lag_s(done.until_ns)
        except Exception:  # the store went away right after the pass
            lag = (self.clock() - done.until_ns) / S
        self.stats.record(done, lag)
        return done

    def run(self, stop: threading.Event) -> None:
        """Pass after pass, every ``every_s``, until ``stop`` is set; the lease is released on the way out. While
        this runs, a heartbeat renews the lease every period, so a pass longer than two periods keeps it, and a
        process that dies loses it within two."""
        beating = threading.Event()
        heartbeat = threading.Thread(
            target=self._heartbeat, args=(beating,), name="stagetrace-analyser-lease", daemon=True
        )
        heartbeat.start()
        due = time.monotonic()
        try:
            while not stop.is_set():
                self.step()
                due = max(due + self.schedule.every_s, time.monotonic())
                if stop.wait(due - time.monotonic()):
                    break
        finally:
            beating.set()
            heartbeat.join(timeout=30)
        try:
            self.release()
        except Exception as exc:  # the store is gone: the lease runs out by itself
            logger.debug("releasing the analyser's lease: %s", exc)

    def _heartbeat(self, stop: threading.Event) -> None:
        lease = None  # on a client of its own: a server store's client runs one query at a time
        try:
            while not stop.wait(self.schedule.every_s):
                if not self.stats.holding:
                    continue
                try:
                    lease = lease or Lease(self.store.another(), self.holder, self.schedule, self.clock)
                    newest = lease.newest()
                    if newest is not None and newest[0] == self.holder:
                        with self._cursor_lock:  # never behind a pass's claim: the cursor only moves forward
                            lease.claim(self._cursor)
                except Exception as exc:  # the pass says so, once
                    logger.debug("renewing the analyser's lease: %s", exc)
        finally:
            if lease is not None and lease.store is not self.store:
                lease.store.close()


def start(
    store: Store, schedule: Schedule, stats: Stats | None = None
) -> tuple[Analyser, threading.Event, threading.Thread]:
    """The loop in a thread of its own (the agent's); set the event and join the thread to stop it."""
    analyser = Analyser(store, schedule, stats=stats)
    stop = threading.Event()
    thread = threading.Thread(target=analyser.run, args=(stop,), name="stagetrace-analyser", daemon=True)
    thread.start()
    return analyser, stop, thread


__all__ = ["Analyser", "DEFAULT_EVERY_S", "Lease", "Pass", "Schedule", "Stats", "start"]
