"""Live analysis at scale: one analyser pass over a minute of new traffic, beside today's way to the same rows
(``divergences`` over the same window, run once a minute), at 100, 1,000 and 10,000 requests/s.

The store is synthetic (``benchmarks.synthetic``: six spans a request, inputs shared 20 at a time, 5% deviating
at a random stage) and holds the analyser's lookback window of history before the new minute, which an earlier
pass has analysed (steady state: the measured pass analyses the new minute, and again the requests of the two
periods before it whose groups the new minute changed). At 10,000 requests/s the history is two minutes: an hour at
that rate (216 million spans) does not fit this machine's disk. The pass's CPU time is the process's (the embedded
engine runs in it), so ``CPU / 60 s`` is the share of a core one pass a minute costs.
"""

from __future__ import annotations

import resource
import statistics
import tempfile
import time

from benchmarks import Figure, benchmark, synthetic
from benchmarks.divergence import _merged
from stagetrace.analysis import divergences, live, population
from stagetrace.store import open_store

S = 1_000_000_000
HISTORY_S = {100: 3600, 1000: 3600, 10_000: 120}  # the store's history before the new minute, by rate


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed_pass(store, rate: int, history_s: int, now: int):
    """Fill ``store`` with ``history_s`` of history at ``rate`` that an earlier pass has seen, then a new minute;
    one pass over it: (the pass, its seconds, its CPU seconds)."""
    synthetic.fill(store, rate * history_s, now - (history_s + 60) * S, seconds=history_s)
    schedule = live.Schedule(settle_s=0, lookback_s=history_s)
    clock = [now - 60 * S]
    analyser = live.Analyser(store, schedule, clock=lambda: clock[0])
    analyser.lease.claim(now - 120 * S)  # where the passes before reached...
    analyser.step()  # ...and the last of them: the analyser has seen the history, as in steady state
    synthetic.fill(store, rate * 60, now - 60 * S, seconds=60, offset=rate * history_s)
    _merged(store)
    clock[0] = now
    cpu, started = _cpu_s(), time.perf_counter()
    done = analyser.run_pass(now - 60 * S)
    return done, time.perf_counter() - started, _cpu_s() - cpu


@benchmark("live")
def live_analysis(quick: bool) -> list[Figure]:
    figures = []
    for rate in (100,) if quick else (100, 1000, 10_000):
        history_s = 600 if quick else HISTORY_S[rate]
        with (
            tempfile.TemporaryDirectory(prefix="stagetrace-bench-") as directory,
            open_store(f"chdb://{directory}") as store,
        ):
            now = time.time_ns()
            done, pass_s, pass_cpu = _timed_pass(store, rate, history_s, now)
            cpu, started = _cpu_s(), time.perf_counter()
            found = divergences.find(store, (history_s + 60) * S, until_ns=now, limit=100)
            scan_s, scan_cpu = time.perf_counter() - started, _cpu_s() - cpu
        figures += [
            Figure(
                f"one pass over a minute at {rate:,}/s ({rate * 60:,} new requests, {done.analysed:,} deviating "
                f"analysed, {history_s // 60} min of history)",
                pass_s,
                "s",
                f"`divergences` over the window ({found['deviating']:,} deviating, latest 100)",
                scan_s,
            ),
            Figure(
                f"its CPU, one pass a minute, at {rate:,}/s",
                100 * pass_cpu / 60,
                "% of a core",
                "`divergences` once a minute",
                100 * scan_cpu / 60,
            ),
        ]
    return figures


@benchmark("live_window")
def live_window(quick: bool) -> list[Figure]:
    """How a pass's cost grows with the history it groups in (issue 32): one pass over a minute at 1,000 requests/s
    in stores whose lookback holds 1 million and 10 million requests (quick: 6,000 and 60,000 at 100/s). A pass
    forms only the groups of the inputs that arrived, so it should cost what the new minute costs."""
    rate, windows = (100, (6_000, 60_000)) if quick else (1000, (1_000_000, 10_000_000))
    figures: list[Figure] = []
    for requests in windows:
        with (
            tempfile.TemporaryDirectory(prefix="stagetrace-bench-") as directory,
            open_store(f"chdb://{directory}") as store,
        ):
            done, pass_s, _ = _timed_pass(store, rate, requests // rate, time.time_ns())
        smallest = figures[0].value if figures else None
        figures.append(
            Figure(
                f"one pass over a minute at {rate:,}/s with {requests:,} requests in the lookback "
                f"({done.analysed:,} deviating analysed)",
                pass_s,
                "s",
                f"the same with {windows[0]:,}" if smallest else "",
                smallest,
            )
        )
    return figures


@benchmark("live_soak")
def live_soak(quick: bool) -> list[Figure]:
    """The analyser as the agent runs it (its own thread, the real clock, a pass a period) while traffic arrives
    second by second into the same embedded store, over an hour of history: does the lag stay flat, and is every
    deviating request listed? Each second brings fresh inputs, 20 requests to each, 5% deviating."""
    rate, soak_s, every_s, settle_s, history_s = (100, 30, 5, 2, 120) if quick else (1000, 600, 60, 10, 3600)
    with (
        tempfile.TemporaryDirectory(prefix="stagetrace-bench-") as directory,
        open_store(f"chdb://{directory}") as store,
    ):
        began = time.time_ns()
        synthetic.fill(store, rate * history_s, began - history_s * S, seconds=history_s)
        _merged(store)
        start = time.time_ns()
        live.Lease(store, "earlier", live.Schedule(every_s=every_s), time.time_ns).claim(start, held=False)
        stats = live.Stats()
        schedule = live.Schedule(every_s=every_s, settle_s=settle_s, lookback_s=history_s)
        analyser, stop, thread = live.start(store, schedule, stats)
        lags, durations, second, sent = [], [], 0, 0
        passes = 0
        while second < soak_s:
            due = start + second * S
            if time.time_ns() < due:
                time.sleep((due - time.time_ns()) / S)
            per_input = synthetic.GROUP
            synthetic.fill(
                store,
                rate,
                due,
                seconds=1,
                offset=rate * history_s + sent,
                inputs_from=10_000_000 + second * max(1, rate // per_input),
            )
            sent += rate
            second += 1
            if stats.passes > passes:
                passes = stats.passes
                lags.append(stats.lag_s)
                durations.append(stats.duration_s)
        time.sleep(every_s + settle_s + 1)  # the last second's requests settle and are analysed
        stop.set()
        thread.join(timeout=600)
        listed = int(
            store.client.command(
                "SELECT count() FROM {db:Identifier}.stagetrace_divergences FINAL "
                "WHERE RequestStart >= fromUnixTimestamp64Nano({t:Int64})",
                parameters={"db": store.database, "t": start},
            )
        )
        deviating = sum(
            1 for d in population.deviations(store, start - history_s * S, time.time_ns()) if d.start_ns >= start
        )
    half = len(lags) // 2
    return [
        Figure(
            f"lag over the last half of a {soak_s / 60:g}-minute soak at {rate:,}/s (mean of {len(lags) - half} "
            f"passes, {every_s:g} s period)",
            statistics.mean(lags[half:] or [0.0]),
            "s",
            "the first half",
            statistics.mean(lags[:half] or [0.0]),
        ),
        Figure(
            f"longest pass in the soak ({len(durations)} passes)",
            max(durations, default=0.0),
            "s",
            "the period",
            every_s,
        ),
        Figure(
            "deviating requests of the soak listed in stagetrace_divergences",
            listed,
            "requests",
            "deviating requests (grouping the whole window afterwards)",
            deviating,
        ),
    ]
