"""The agent's path into the store alone: a spool of OTLP requests (the records the agent writes ahead before it
answers a sender) replayed into an embedded store with stagetrace's schema, and into the same store without its
views (the bare ``otel_traces``), by how many rows one insert takes (``MAX_GROUP_ROWS``), side by side in one run.

Under load the agent's backlog groups records into inserts of up to that many rows, so the views' cost of an insert
(planned anew for each, ``views_profile``) is shared by that many spans. Each replay starts from the same spool on a
fresh store in a process of its own, group sizes taking turns; the figures are medians over rounds of that process's
CPU time a stored span (the replay thread, the decoding, and the engine with its merges, which run in the
process), and of its peak resident memory above what it held before the replay. Every span is read back: a replay
that stored fewer than the spool held fails the run.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import resource
import statistics
import tempfile
from pathlib import Path

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

from benchmarks import Figure, benchmark
from benchmarks.export import make_spans
from benchmarks.ingest import _status_mib
from stagetrace import schema
from stagetrace.exporters import spool
from stagetrace.exporters.durable import MAX_GROUP_ROWS, DurableWriter
from stagetrace.store import open_store

REQUEST_SPANS = 512  # the OpenTelemetry SDK's batch (BatchSpanProcessor's max_export_batch_size)
GROUP_ROWS = (8_192, 32_768, 65_536)  # the first: the agent's until issue 32, the baseline


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def replay(payloads: list[tuple[bytes, int]], group_rows: int, views: bool = True) -> tuple[float, float]:
    """(CPU microseconds a stored span, MiB of peak resident memory above the process's before) for one replay of
    ``payloads`` in this process; ``views``: False for a store whose ``otel_traces`` has none (the bare table)."""
    logging.getLogger(spool.__name__).setLevel(logging.ERROR)  # "holds rows from an earlier run": it does
    with tempfile.TemporaryDirectory(prefix="stagetrace-bench-") as directory:
        base = Path(directory) / "spool"
        filled = spool.Spool(base / "spans")  # where the writer of kind "spans" looks
        for payload, spans in payloads:
            filled.put_record("otlp_traces", payload, spans, spool.new_token())
        filled.close()
        with open_store(f"chdb://{directory}/store") as store:
            if not views:
                for view in schema.VIEWS:
                    store.client.command(f"DROP VIEW {schema.identifier(store.database)}.`{view.name}`")
            before, cpu = _status_mib(os.getpid(), "VmRSS"), _cpu_s()
            writer = DurableWriter(store, "spans", spool_dir=base, group_rows=group_rows)
            drained = writer.flush(timeout_s=600)
            cpu = _cpu_s() - cpu
            peak = _status_mib(os.getpid(), "VmHWM")  # since the process began (ru_maxrss has the parent's too)
            writer.close()
            stored = int(
                store.client.command(
                    "SELECT count() FROM {db:Identifier}.otel_traces", parameters={"db": store.database}
                )
            )
    expected = sum(spans for _, spans in payloads)
    if not drained or stored != expected:
        raise RuntimeError(f"the replay in groups of {group_rows:,} rows stored {stored:,} of {expected:,} spans")
    return cpu / stored * 1e6, max(0.0, peak - before)


@benchmark("replay")
def replay_by_group(quick: bool) -> list[Figure]:
    requests, rounds = (2_000, 1) if quick else (20_000, 3)
    spans = make_spans(requests)
    payloads = [
        (encode_spans(spans[i : i + REQUEST_SPANS]).SerializeToString(), len(spans[i : i + REQUEST_SPANS]))
        for i in range(0, len(spans), REQUEST_SPANS)
    ]
    runs = [(size, views) for size in GROUP_ROWS for views in (True, False)]
    cpu: dict[tuple, list[float]] = {run: [] for run in runs}
    memory: dict[tuple, list[float]] = {run: [] for run in runs}
    spawn = multiprocessing.get_context("spawn")  # a fresh process a replay: its peak memory is the replay's own
    for r in range(rounds):
        for run in runs if r % 2 == 0 else reversed(runs):
            with spawn.Pool(1) as pool:
                microseconds, mib = pool.apply(replay, (payloads, *run))
            cpu[run].append(microseconds)
            memory[run].append(mib)
    cpu_of = {run: statistics.median(values) for run, values in cpu.items()}
    first = GROUP_ROWS[0]
    figures = []
    for size in GROUP_ROWS:
        label = f"{len(spans):,} spans in {len(payloads)} requests replayed in groups of up to {size:,} rows"
        label += " (MAX_GROUP_ROWS)" if size == MAX_GROUP_ROWS else ""
        figures.append(
            Figure(
                f"{label}: CPU a stored span, every view",
                cpu_of[size, True],
                "µs",
                "bare otel_traces, the same groups",
                cpu_of[size, False],
            )
        )
        if size != first:
            figures.append(
                Figure(
                    f"{label}: CPU a stored span, every view",
                    cpu_of[size, True],
                    "µs",
                    f"groups of up to {first:,} rows",
                    cpu_of[first, True],
                )
            )
        figures.append(
            Figure(
                f"{label}: peak resident memory above the process's before, every view",
                statistics.median(memory[size, True]),
                "MiB",
                f"groups of up to {first:,} rows",
                statistics.median(memory[first, True]),
            )
        )
    return figures
