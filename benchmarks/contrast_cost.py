"""The stage contrast's cost (issue 51): ``population.contrasts`` at a million requests, beside a baseline's.

Since issue 51 the contrast also counts every setting and identity each span records (what explaining away
needs), which made ``explain`` and a live pass dearer. This benchmark times the query alone, this tree's and a
baseline tree's ``analysis/population.py`` (``git show BASELINE:...``, default ``main``; set
``STAGETRACE_BASELINE``) on the same synthetic store (``benchmarks.synthetic``), calls interleaved so that both
meet the same load, and checks that both give the same contrasts (counts, identifiers and what each cause
explains): a cheaper query that changed an answer would fail here. Two calls:

- ``explain``'s: one stage, the contrast window narrowed to ``CONTRAST_REQUESTS`` around one request, its majority
  over the 48 hours around it;
- the tally's (``divergences`` and each live pass): every stage, over the whole window.

CPU seconds are those of this process (the embedded engine runs in it): on a shared machine they move less than
wall time.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import Figure, benchmark, synthetic
from benchmarks.divergence import _merged
from stagetrace.analysis import population
from stagetrace.analysis.explain import CONTRAST_WINDOW_NS, DEFAULT_WINDOW_NS, contrast_window
from stagetrace.store import open_store

ROOT = Path(__file__).resolve().parents[1]
S = 10**9
RUNS = 3


def _baseline():
    """(its name, the baseline tree's ``population`` module loaded beside this tree's, which it imports the rest
    from); without git or that commit, (a note, None): the figures then stand alone."""
    ref = os.environ.get("STAGETRACE_BASELINE", "main")
    shown = subprocess.run(
        ["git", "show", f"{ref}:src/stagetrace/analysis/population.py"], cwd=ROOT, capture_output=True, text=True
    )
    if shown.returncode != 0:
        return f"(no baseline: {ref} not found)", None
    source = shown.stdout
    name = "stagetrace_baseline_population"
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, f.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    os.unlink(f.name)
    return ref, module


def _answers(found: dict) -> dict:
    return {at: (c.counts, c.prior, c.identifiers, c.explained) for at, c in found.items()}


def _timed(call) -> tuple[float, float, dict]:
    cpu, started = time.process_time(), time.perf_counter()
    found = call()
    return time.perf_counter() - started, time.process_time() - cpu, found


@benchmark("contrast_cost")
def contrast_cost(quick: bool) -> list[Figure]:
    requests = 20_000 if quick else 1_000_000
    ref, baseline = _baseline()
    figures = []
    with (
        tempfile.TemporaryDirectory(prefix="stagetrace-bench-") as directory,
        open_store(f"chdb://{directory}") as store,
    ):
        now = time.time_ns()
        t0 = now - 3600 * S
        synthetic.fill(store, requests, t0)
        _merged(store)
        middle = t0 + 1800 * S
        stages = ("retrieval", "cache", "context_assembly", "allreduce", "decode")
        calls = {
            f"explain's contrast at {requests:,} requests (one stage, narrowed window)": (
                {"allreduce": ["setting.allreduce"]},
                contrast_window(store, middle, middle, CONTRAST_WINDOW_NS),
                (middle - DEFAULT_WINDOW_NS, middle + DEFAULT_WINDOW_NS),
            ),
            f"the tally's contrasts at {requests:,} requests (five stages, the whole window)": (
                {stage: [f"setting.{stage}"] for stage in stages},
                (t0, now),
                None,
            ),
        }
        for label, (keys, window, majority) in calls.items():
            timings: dict[str, list[tuple[float, float]]] = {"this": [], "baseline": []}
            answers = {}
            for _ in range(1 if quick else RUNS):
                for which, module in (("this", population), ("baseline", baseline)):
                    if module is None:
                        continue
                    wall, cpu, found = _timed(lambda m=module: m.contrasts(store, keys, *window, (), majority))
                    timings[which].append((wall, cpu))
                    answers[which] = _answers(found)
            assert baseline is None or answers["this"] == answers["baseline"], (
                f"{label}: the contrasts differ from {ref}'s"
            )
            for unit, i in (("s", 0), ("CPU s", 1)):
                figures.append(
                    Figure(
                        f"{label}, {'wall' if i == 0 else 'CPU'}",
                        statistics.median(t[i] for t in timings["this"]),
                        unit,
                        ref,
                        statistics.median(t[i] for t in timings["baseline"]) if baseline else None,
                    )
                )
    return figures
