"""The benchmark runner works end to end in its quick mode (figures are not asserted: this is not a timed test)."""

import shutil
import subprocess
import sys
from pathlib import Path

from stagetrace import schema

ROOT = Path(__file__).resolve().parents[1]


def test_quick_run_prints_and_writes_every_figure(tmp_path):
    output = tmp_path / "RESULTS.md"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--output", str(output)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,  # a guard against a hang, not a time limit: every quick benchmark, on a shared 2-core machine
    )
    assert result.returncode == 0, result.stderr
    written = output.read_text()
    for line in ("# Benchmark results", "- date: ", "- commit: ", "- machine: ", "| benchmark | figure | value |"):
        assert line in written
    rows = [line for line in written.splitlines() if line.startswith("| collection |")]
    assert [r.split(" | ")[1].split(",")[0].split(" (")[0] for r in rows] == [
        "RDMA collector",
        "RDMA collector",
        "RDMA collector",
        "whole-node snapshot in-process",
        "`stagetrace collect --once` process",
        "gpu collector scrape at 1 s",
        "GPM's cost per GPU per scrape",
    ]  # against node_exporter, node_exporter on the same files, coreutils cat; GPM on against off
    assert all(line in result.stdout for line in rows)
    rdma = rows[0].split(" | ")
    assert rdma[2].endswith(" ms")
    if shutil.which("prometheus-node-exporter"):  # the ratio against node_exporter's own timing
        assert rdma[3].startswith("node_exporter ") and rdma[5].endswith("× |")
    # every other benchmark's rows, with their baselines where they have one
    for name, count, baselines in (
        ("instrumentation", 2, ["bare OpenTelemetry SDK"] * 2),
        ("export", 2, ["raw columnar client.insert"] * 2),
        ("lookup", 6, ["", "full scan", "full scan", "same filter through the bloom-filter", "full scan", "aim"]),
        ("startup", 5, ["aim", "`python -c pass`", "`python -c pass`", "aim", "`python -c pass`"]),
        ("footprint", 10, ["aim", "aim", "aim", "aim", "aim", "aim", "aim", "", "", ""]),
        ("storage", 4, [""] * 4),  # and one row per table a view fills from otel_traces
        ("conventions", 2, ["as stagetrace-convention spans", "stagetrace-convention requests"]),
        ("otlp_ingest", 1, ["OTLP/HTTP, same spans"]),
        ("durability", 14, [""] * 14),  # nine figures and one per drop reason
        ("live", 2, ["`divergences` over the window", "`divergences` once a minute"]),
        ("live_window", 2, ["", "the same with 6,000"]),
        ("tensors", 5, [".float().cpu().numpy()"] * 3 + ["", "NumPy lanes"]),
        ("decode", 2, ["the same loop unrecorded"] * 2),
        ("generations", 4, ["the Collector's previous layout"] * 4),
        # two corpora: every view now and before, each table's alone now and, where schema 10 had it, before
        ("views", 18, ["bare otel_traces"] * 18),
        ("views_by_insert", 12, ["bare otel_traces"] * 12),  # three insert sizes, two corpora, now and before
        # three insert sizes and three rates, each on the Map and the JSON layout and refreshed (issue 55)
        ("views_by_writer", 18, ["bare otel_traces"] * 18),
        # two corpora: an insert of one request, a span more and a large insert against the bare table, the size from
        # which the aim holds; between them each view's planning against a one-column query
        (
            "views_profile",
            8 + len(schema.VIEWS),
            ["bare otel_traces"] * 3
            + [""]
            + ["a one-column query"] * len(schema.VIEWS)
            + ["bare otel_traces"] * 3
            + [""],
        ),
        # three group sizes: against the bare table, against 8,192-row groups (but the first), the memory
        (
            "replay",
            8,
            ["bare otel_traces", "groups of up to 8,192"]
            + ["bare otel_traces", "groups of up to 8,192", "groups of up to 8,192"] * 2,
        ),
        ("ingest", 41, [""] * 41),  # the fleet into an embedded store (20 figures) and a server store (21)
        ("neighbours", 2, ["aim"] * 2),  # explain and divergences, each against its aim
        ("concurrent_faults", 2, ["aim"] * 2),
    ):
        cells = [r.split(" | ") for r in written.splitlines() if r.startswith(f"| {name} |")]
        assert len(cells) == count or name == "storage" and len(cells) > count, (name, cells)
        assert [c[3].startswith(b) if b else c[3] == "—" for c, b in zip(cells, baselines)] == [True] * count, cells
        assert all(c[2] != "—" for c in cells), cells  # every figure has a value


def test_unknown_benchmark_is_a_usage_error():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "nope"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 2 and "unknown benchmark nope: choose from collection" in result.stderr
