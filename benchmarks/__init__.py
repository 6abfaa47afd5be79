"""Benchmarks, not timed tests: ``python -m benchmarks [--quick] [NAME ...]`` prints a table of figures and,
on a full run, writes ``benchmarks/RESULTS.md`` (machine, date, commit, each figure with its baseline and ratio).

A benchmark is a function ``(quick) -> list[Figure]`` registered by name with ``@benchmark("name")`` in a
module listed in ``MODULES``; ``quick`` asks for few repetitions (the test suite runs that mode once).
"""

from __future__ import annotations

import importlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

MODULES = (
    "collection",
    "divergence",
    "instrumentation",
    "export",
    "otlp_ingest",
    "lookup",
    "startup",
    "footprint",
    "storage",
    "soak",
    "durability",
    "live",
    "tensors",
    "generations",
    "views",
    "replay",
    "ingest",
    "neighbours",
    "contrast_cost",
    "tally_cost",
)


@dataclass(frozen=True)
class Figure:
    """One measured figure; ``baseline`` names what it is compared with, if anything."""

    name: str
    value: float
    unit: str
    baseline: str = ""
    baseline_value: float | None = None

    @property
    def ratio(self) -> float | None:
        return self.value / self.baseline_value if self.baseline_value else None


BENCHMARKS: dict[str, Callable[[bool], list[Figure]]] = {}


def benchmark(name: str):
    """Register a benchmark function under ``name``."""

    def register(function: Callable[[bool], list[Figure]]):
        if name in BENCHMARKS:
            raise ValueError(f"benchmark {name!r} is registered twice")
        BENCHMARKS[name] = function
        return function

    return register


def load() -> dict[str, Callable[[bool], list[Figure]]]:
    for module in MODULES:
        importlib.import_module(f"benchmarks.{module}")
    return BENCHMARKS


def compile_sources() -> None:
    """Write the bytecode of stagetrace's own modules, as ``pip install`` does for an installed package: a checkout
    run with ``PYTHONDONTWRITEBYTECODE`` (this workplace sets it) compiles every module it imports anew in each
    process, about 15 ms a command, which no installed stagetrace pays."""
    import compileall
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for folder in ("src", "collectors", "exporters", "dashboards"):
        compileall.compile_dir(root / folder, quiet=1)


def median_seconds(function: Callable[[], object], runs: int, warmup: int = 1) -> float:
    """Median wall time of ``function`` over ``runs`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        function()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)
