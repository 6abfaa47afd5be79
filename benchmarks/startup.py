"""Command-line start-up: ``stagetrace --help`` as a process, beside the interpreter's own start-up.

Operators run the CLI in loops and scripts, so its start-up is part of every answer. The floor is
``python -c pass`` with the same interpreter and site packages (the editable install's path finder
included): what no command can go below. Runs alternate; medians are reported. stagetrace's modules are
byte-compiled first, as an installed package's are (``benchmarks.compile_sources``).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from benchmarks import Figure, benchmark, compile_sources


def _run_ms(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, capture_output=True, check=True)
    return (time.perf_counter() - started) * 1e3


@benchmark("startup")
def startup(quick: bool) -> list[Figure]:
    runs = 3 if quick else 21
    compile_sources()
    floor, help_ = [], []
    for _ in range(runs):
        floor.append(_run_ms([sys.executable, "-c", "pass"]))
        help_.append(_run_ms([sys.executable, "-m", "stagetrace", "--help"]))
    floor_ms = statistics.median(floor)
    return [
        Figure(f"`stagetrace --help` process, median of {runs}", statistics.median(help_), "ms", "aim", 100.0),
        Figure(f"`stagetrace --help` process, median of {runs}", statistics.median(help_), "ms",
               "`python -c pass`, same interpreter", floor_ms),
    ]  # fmt: skip
