"""``python -m benchmarks [--quick] [--output FILE] [NAME ...]``: run benchmarks, print a table, write RESULTS.md."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import Figure, load

ROOT = Path(__file__).resolve().parents[1]


def _commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return f"{commit} (with uncommitted changes)" if git("status", "--porcelain") else commit


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def _number(value: float | None, unit: str = "") -> str:
    if value is None:
        return "—"
    if value == float("inf"):
        return "never"
    return f"{value:,.0f} {unit}".strip() if abs(value) >= 10_000 else f"{value:.3g} {unit}".strip()


def table(results: dict[str, list[Figure]]) -> list[str]:
    lines = ["| benchmark | figure | value | baseline | baseline value | ratio |", "|---|---|---|---|---|---|"]
    for name, figures in results.items():
        for f in figures:
            ratio = "—" if f.ratio is None else f"{f.ratio:.2f}×"
            baseline_value = _number(f.baseline_value, f.unit)
            lines.append(
                f"| {name} | {f.name} | {_number(f.value, f.unit)} | {f.baseline or '—'} | {baseline_value} | {ratio} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    known = load()
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run (default all: {', '.join(known)})")
    parser.add_argument(
        "--quick", action="store_true", help="few repetitions; does not write RESULTS.md unless --output"
    )
    parser.add_argument(
        "--output", type=Path, help="where to write the results (default benchmarks/RESULTS.md on a full run)"
    )
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)}: choose from {', '.join(known)}")
    # every temporary store under one folder, removed at the end with what lies beside a store there (an embedded
    # store's default spool is ``<store>.spool``, which would outlive the store's own temporary directory)
    previous = tempfile.tempdir
    with tempfile.TemporaryDirectory(prefix="stagetrace-bench-") as scratch:
        tempfile.tempdir = scratch
        try:
            results = {name: known[name](args.quick) for name in (args.names or known)}
        finally:
            tempfile.tempdir = previous
    lines = table(results)
    print("\n".join(lines))
    output = args.output or (None if args.quick else ROOT / "benchmarks" / "RESULTS.md")
    if output is not None:
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        header = [
            "# Benchmark results",
            "",
            f"- date: {now}",
            f"- commit: {_commit()}",
            f"- machine: {_machine()}",
            f"- mode: {'quick' if args.quick else 'full'} (`python -m benchmarks{' --quick' if args.quick else ''}`)",
            "- ratio: value / baseline value (below 1: faster than the baseline)",
            "",
        ]
        output.write_text("\n".join(header + lines) + "\n")
        print(f"wrote {output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
