"""The tally's SQL with the references (issue 52): ``population.first_differences`` beside a baseline's.

Where several TP ranks began a deviation's difference against its baseline, the tally's SQL checks them against two
more requests with the majority output, as ``explain`` does: it reads those requests' stage spans too. This times
the query alone, this tree's and a baseline tree's ``analysis/population.py`` (``STAGETRACE_BASELINE``, default
``main``, loaded as ``contrast_cost`` loads it) on the same synthetic store (``benchmarks.synthetic``: 5% of the
requests deviate), after one untimed call of each, calls interleaved (each first in turn), and checks that both find
the same stage and attributes for every deviation. The synthetic requests record no ranks: the references change
nothing there, and cost what finding that they have no ranked stage costs.
"""

from __future__ import annotations

import statistics
import tempfile
import time

from benchmarks import Figure, benchmark, synthetic
from benchmarks.contrast_cost import _baseline, _timed
from benchmarks.divergence import _merged
from stagetrace.analysis import population
from stagetrace.store import open_store

S = 10**9
RUNS = 3


def _answers(found: dict) -> dict:
    return {trace: (d.stage, sorted(d.attributes), sorted(d.resource), d.rank) for trace, d in found.items()}


@benchmark("tally_cost")
def tally_cost(quick: bool) -> list[Figure]:
    requests = 10_000 if quick else 100_000
    ref, baseline = _baseline()
    timings: dict[str, list[tuple[float, float]]] = {"this": [], "baseline": []}
    answers = {}
    with (
        tempfile.TemporaryDirectory(prefix="stagetrace-bench-") as directory,
        open_store(f"chdb://{directory}") as store,
    ):
        now = time.time_ns()
        t0 = now - 3600 * S
        synthetic.fill(store, requests, t0)
        _merged(store)
        window = (t0 - 60 * S, now + 60 * S)
        modules = [(which, m) for which, m in (("this", population), ("baseline", baseline)) if m is not None]
        for which, module in modules:  # untimed: the first call reads the spans from disk for both
            module.first_differences(store, t0, now, window)
        for run in range(1 if quick else RUNS):
            for which, module in modules[::-1] if run % 2 else modules:  # each goes first in turn
                wall, cpu, found = _timed(lambda m=module: m.first_differences(store, t0, now, window))
                timings[which].append((wall, cpu))
                answers[which] = _answers(found)
    assert answers["this"], "no deviation found"
    assert baseline is None or answers["this"] == answers["baseline"], f"the first differences differ from {ref}'s"
    label = f"the tally's first differences at {requests:,} requests ({len(answers['this']):,} deviating)"
    return [
        Figure(
            f"{label}, {'wall' if i == 0 else 'CPU'}",
            statistics.median(t[i] for t in timings["this"]),
            unit,
            ref,
            statistics.median(t[i] for t in timings["baseline"]) if baseline else None,
        )
        for unit, i in (("s", 0), ("CPU s", 1))
    ]
