"""Command-line start-up: ``stagetrace --help``, ``import stagetrace.cli`` and ``stagetrace trace --json`` through an
agent as processes, beside the interpreter's own start-up.

Operators run the CLI in loops and scripts, so its start-up is part of every answer. The floor is
``python -c pass`` with the same interpreter and site packages (the editable install's path finder
included): what no command can go below. The trace is looked up in a small synthetic store held by
``stagetrace agent`` (read through its query endpoint), each process asking for a request ID not asked for before:
what is measured is the process, whose start-up does not depend on the store's size. Runs alternate; medians are
reported. stagetrace's modules are byte-compiled first, as an installed package's are (``benchmarks.compile_sources``).

``STAGETRACE_BENCH_BEFORE=DIR`` (a checkout of another commit, e.g. ``git worktree add DIR COMMIT``) measures the
same processes with that checkout's stagetrace too, alternating with this one's, and compares the two side by side;
both run through the same package of links (``_checkout_env``), so the way modules are found is the same for both.
The agent and the store are this checkout's in both.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from benchmarks import Figure, benchmark, compile_sources

BEFORE_ENV = "STAGETRACE_BENCH_BEFORE"
PACKAGES = ("collectors", "exporters", "dashboards")  # beside src/stagetrace in a checkout, subpackages when installed
ROOT = Path(__file__).resolve().parents[1]
REQUESTS = 2_000  # in the store the agent holds: enough for fresh IDs, small enough to fill in a second


def _run_ms(command: list[str], env: dict | None = None) -> float:
    started = time.perf_counter()
    subprocess.run(command, capture_output=True, check=True, env=env)
    return (time.perf_counter() - started) * 1e3


def _checkout_env(checkout: Path, directory: Path) -> dict:
    """The environment in which ``python -m stagetrace`` runs ``checkout``'s code: a package of links to its
    modules under ``directory``, first on PYTHONPATH (ahead of the editable install's finder, which comes last)."""
    import compileall

    package = directory / "stagetrace"
    package.mkdir()
    for entry in (checkout / "src" / "stagetrace").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name in PACKAGES:
        (package / name).symlink_to(checkout / name)
    # the links' own bytecode beside them, the linked folders' (which compileall does not follow) in the checkout
    compileall.compile_dir(package, quiet=1, maxlevels=0)
    for folder in (checkout / "src" / "stagetrace", *(checkout / name for name in PACKAGES)):
        compileall.compile_dir(folder, quiet=1)
    return {**os.environ, "PYTHONPATH": str(directory)}


@benchmark("startup")
def startup(quick: bool) -> list[Figure]:
    from benchmarks.lookup import held_by_agent, trace_process_ms
    from benchmarks.synthetic import fill
    from stagetrace.store import open_store

    runs = 3 if quick else 21
    compile_sources()
    before_dir = os.environ.get(BEFORE_ENV)
    with ExitStack() as stack:
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="stagetrace-bench-")))
        trees = {"this": None}
        if before_dir:
            for tree, checkout in (("linked", ROOT), ("before", Path(before_dir).resolve())):
                (directory / tree).mkdir()
                trees[tree] = _checkout_env(checkout, directory / tree)
        dsn = f"chdb://{directory / 'store'}"
        with open_store(dsn) as store:
            fill(store, REQUESTS, time.time_ns() - 3600 * 10**9)
        stack.enter_context(held_by_agent(dsn))
        fresh = iter(range(REQUESTS))
        times: dict[tuple[str, str], list[float]] = {}
        for run in range(runs):
            for tree, env in list(trees.items())[:: -1 if run % 2 else 1]:  # each tree first as often as last
                for what, measure in (
                    ("floor", lambda: _run_ms([sys.executable, "-c", "pass"], env)),
                    ("help", lambda: _run_ms([sys.executable, "-m", "stagetrace", "--help"], env)),
                    ("import", lambda: _run_ms([sys.executable, "-c", "import stagetrace.cli"], env)),
                    ("trace", lambda: trace_process_ms(dsn, f"req-{next(fresh)}", env)),
                ):
                    times.setdefault((tree, what), []).append(measure())
    ms = {key: statistics.median(values) for key, values in times.items()}
    floor = ms[("this", "floor")]
    help_ = f"`stagetrace --help` process, median of {runs}"
    import_ = f"`python -c 'import stagetrace.cli'`, median of {runs}"
    trace = f"`stagetrace trace --json` process through an agent holding {REQUESTS:,} requests, median of {runs}"
    figures = [
        Figure(help_, ms[("this", "help")], "ms", "aim", 100.0),
        Figure(help_, ms[("this", "help")], "ms", "`python -c pass`, same interpreter", floor),
        Figure(import_, ms[("this", "import")], "ms", "`python -c pass`, same interpreter", floor),
        Figure(trace, ms[("this", "trace")], "ms", "aim (through an agent holding 100M spans)", 250.0),
        Figure(trace, ms[("this", "trace")], "ms", "`python -c pass`, same interpreter", floor),
    ]
    if before_dir:
        before = f"the same at {_short_commit(before_dir)}, alternating"
        figures += [
            Figure(name, ms[("linked", what)], "ms", before, ms[("before", what)])
            for name, what in ((help_, "help"), (import_, "import"), (trace, "trace"))
        ]
    return figures


def _short_commit(checkout: str) -> str:
    result = subprocess.run(["git", "-C", checkout, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return result.stdout.strip() or checkout
