"""Per-GPU collective time and bus bandwidth from NCCL Inspector's Prometheus dumps.

With ``NCCL_INSPECTOR_PROM_DUMP=1`` the Inspector profiler plugin writes one file per GPU,
``<NCCL_INSPECTOR_DUMP_DIR>/nccl_inspector_metrics_<uuid>.prom``, for node_exporter's textfile
collector: bare samples without HELP/TYPE, rewritten every dump interval (30 s at least in this mode)
and deleted when the job ends (NVIDIA/nccl ``plugins/profiler/inspector/inspector_prom.cc`` and
README). Per (communicator, collective, message-size bucket, algorithm_protocol) it holds the
*arithmetic mean* execution time in µs and the *geometric mean* bus bandwidth in GB/s (1e9 bytes/s)
over the interval; P2P the same per operation; with ``NCCL_INSPECTOR_PROM_DUMP_STATS=1`` also
cumulative operation and drop counts per GPU.

This collector reads that directory (``Options.nccl_dir``) with client_python's text parser and
re-exports the samples in base units, beside the GPU and NIC series:

- ``uuid`` is the file's GPU UUID in NVML's form (``GPU-…``) so it joins the gpu collector's series;
  the dump's ``gpu`` label (``GPU<n>``) is the *CUDA* device index, which ``CUDA_VISIBLE_DEVICES``
  renumbers, so it becomes ``cuda_device`` and not ``gpu``;
- ``node`` stays: a dump directory on shared storage holds other hosts' GPUs too; ``version`` goes.

A dump older than ``stale_after`` seconds (the job hung or died without tearing down, or the GPU
ran no collective since) is not re-exported, or its last averages would look current forever;
``nccl_inspector_dump_age_seconds{uuid}`` still shows it. A dump that does not parse is skipped
with one log line per version of the file; the others are still read.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from stagetrace.collectors.base import (
    COUNTER,
    GAUGE,
    Collector,
    MetricSpec,
    Samples,
    Setting,
    SourceUnavailable,
    path_or_none,
    register,
)
from stagetrace.environment_variables import STAGETRACE_NCCL_DIR

logger = logging.getLogger("stagetrace.collectors.nccl")

DUMP_PREFIX, DUMP_SUFFIX = "nccl_inspector_metrics_", ".prom"

DEVICE_LABELS = ("uuid", "cuda_device", "node", "slurm_job_id")
COMMUNICATOR_LABELS = (*DEVICE_LABELS, "comm_name", "n_nodes", "nranks")
COLLECTIVE_LABELS = (*COMMUNICATOR_LABELS, "collective", "message_size", "algo_proto")
P2P_LABELS = (*COMMUNICATOR_LABELS, "p2p_operation", "message_size")

_MEAN_OVER_DUMP = "over the last NCCL Inspector dump interval"

# Inspector sample name -> (stagetrace spec, base units per Inspector unit as numerator, denominator)
INSPECTOR_METRICS: dict[str, tuple[MetricSpec, int, int]] = {
    "nccl_collective_exec_time_microseconds": (
        MetricSpec(
            "nccl_collective_time_seconds",
            GAUGE,
            f"Mean execution time of a collective {_MEAN_OVER_DUMP}.",
            COLLECTIVE_LABELS,
            "seconds",
        ),
        1,
        1_000_000,
    ),
    "nccl_bus_bandwidth_gbs": (
        MetricSpec(
            "nccl_collective_bus_bandwidth_bytes_per_second",
            GAUGE,
            f"Geometric mean bus bandwidth of a collective {_MEAN_OVER_DUMP}.",
            COLLECTIVE_LABELS,
            "bytes_per_second",
        ),
        1_000_000_000,
        1,
    ),
    "nccl_p2p_exec_time_microseconds": (
        MetricSpec(
            "nccl_p2p_time_seconds",
            GAUGE,
            f"Mean execution time of a send or receive {_MEAN_OVER_DUMP}.",
            P2P_LABELS,
            "seconds",
        ),
        1,
        1_000_000,
    ),
    "nccl_p2p_bus_bandwidth_gbs": (
        MetricSpec(
            "nccl_p2p_bus_bandwidth_bytes_per_second",
            GAUGE,
            f"Geometric mean bus bandwidth of a send or receive {_MEAN_OVER_DUMP}.",
            P2P_LABELS,
            "bytes_per_second",
        ),
        1_000_000_000,
        1,
    ),
    "nccl_collectives_total": (
        MetricSpec("nccl_collectives_total", COUNTER, "Collectives NCCL Inspector recorded on the GPU.", DEVICE_LABELS),
        1,
        1,
    ),
    "nccl_collectives_dropped_total": (
        MetricSpec(
            "nccl_collectives_dropped_total",
            COUNTER,
            "Collectives NCCL Inspector recorded but overwrote before dumping them.",
            DEVICE_LABELS,
        ),
        1,
        1,
    ),
    "nccl_p2p_total": (
        MetricSpec(
            "nccl_p2p_operations_total",
            COUNTER,
            "Sends and receives NCCL Inspector recorded on the GPU.",
            DEVICE_LABELS,
        ),
        1,
        1,
    ),
    "nccl_p2p_dropped_total": (
        MetricSpec(
            "nccl_p2p_operations_dropped_total",
            COUNTER,
            "Sends and receives NCCL Inspector recorded but overwrote before dumping them.",
            DEVICE_LABELS,
        ),
        1,
        1,
    ),
}

DUMP_AGE = MetricSpec(
    "nccl_inspector_dump_age_seconds",
    GAUGE,
    "Seconds since NCCL Inspector last wrote the GPU's dump; its series are left out once it is stale.",
    ("uuid",),
    "seconds",
)


class BadDump(Exception):
    """A dump file that does not parse as Prometheus text."""


def read_dump(path: Path) -> list[tuple[str, dict[str, str], float]]:
    """The (name, labels, value) samples of one dump, in file order."""
    text = path.read_bytes().decode("utf-8", "replace")
    if not text.endswith("\n"):
        # The plugin truncates the file, then appends line by line: a line without its newline is
        # still being written. Read what is complete.
        text = text[: text.rfind("\n") + 1]
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise BadDump(str(exc) or "not Prometheus text") from None
    return [(sample.name, sample.labels, sample.value) for family in families for sample in family.samples]


def _uuid(path: Path) -> str:
    """``nccl_inspector_metrics_8f6c…-….prom`` -> ``GPU-8f6c…-…`` (the plugin writes the UUID without NVML's prefix)."""
    raw = path.name[len(DUMP_PREFIX) : -len(DUMP_SUFFIX)]
    return raw if raw.startswith(("GPU-", "MIG-")) else f"GPU-{raw}"


# NCCL_INSPECTOR_DUMP_DIR: the plugin's own variable, so an agent started in the job's environment finds the dumps
DUMP_DIR = Setting(
    "nccl_dir",
    path_or_none,
    env=(STAGETRACE_NCCL_DIR, "NCCL_INSPECTOR_DUMP_DIR"),
    flag="--nccl-dir",
    metavar="DIR",
    help="the directory NCCL Inspector dumps into (its NCCL_INSPECTOR_DUMP_DIR)",
)


@register
class NcclCollector(Collector):
    """NCCL Inspector's per-GPU collective performance, read from its Prometheus dump directory."""

    name = "nccl"
    settings = (DUMP_DIR,)
    # Opt-in: only nodes whose jobs run the Inspector plugin have dumps to read (--collectors ...,nccl).
    default_enabled = False
    # Seconds: ten dump intervals at the plugin's 30 s minimum in Prometheus mode. None keeps every dump
    # whatever its age (a site whose interval is longer, recorded fixtures).
    stale_after: float | None = 300.0

    def __init__(self, options):
        super().__init__(options)
        self._reported_bad: dict[Path, int] = {}  # dump -> mtime_ns already logged as malformed

    def dumps(self) -> list[Path]:
        directory = self.options.nccl_dir
        if directory is None:
            raise SourceUnavailable(
                "no NCCL Inspector dump directory: set STAGETRACE_NCCL_DIR to the jobs' NCCL_INSPECTOR_DUMP_DIR"
            )
        try:
            names = sorted(os.listdir(directory))
        except OSError as exc:
            raise SourceUnavailable(f"NCCL Inspector dump directory {directory}: {exc.strerror}") from None
        return [Path(directory, n) for n in names if n.startswith(DUMP_PREFIX) and n.endswith(DUMP_SUFFIX)]

    def collect(self, out: Samples) -> None:
        now = time.time()
        for path in self.dumps():
            uuid, mtime_ns = _uuid(path), None
            try:
                mtime_ns = path.stat().st_mtime_ns
                age = max(0.0, now - mtime_ns / 1e9)
                if self.stale_after is not None and age > self.stale_after:
                    out.add(DUMP_AGE, age, uuid=uuid)
                    continue
                samples = read_dump(path)
            except FileNotFoundError:  # the job ended between listing and reading: its dump is gone
                continue
            except (OSError, BadDump) as exc:
                if self._reported_bad.get(path) != mtime_ns:
                    logger.warning("nccl: skipping dump %s: %s", path, exc)
                    self._reported_bad[path] = mtime_ns
                continue
            self._reported_bad.pop(path, None)
            out.add(DUMP_AGE, age, uuid=uuid)
            self._add(out, uuid, samples)

    @staticmethod
    def _add(out: Samples, uuid: str, samples: list[tuple[str, dict[str, str], float]]) -> None:
        latest: dict[tuple[MetricSpec, tuple[str, ...]], float] = {}
        for name, labels, value in samples:
            known = INSPECTOR_METRICS.get(name)
            if known is None:  # a metric this version does not know (e.g. a newer plugin's): not ours to guess
                continue
            spec, numerator, denominator = known
            labels = {**labels, "uuid": uuid, "cuda_device": labels.get("gpu", "").removeprefix("GPU")}
            # a file appended to across dumps repeats a series: the later line is the newer value
            latest[(spec, tuple(labels.get(k, "") for k in spec.labels))] = value * numerator / denominator
        for (spec, values), value in latest.items():
            out.add(spec, value, **dict(zip(spec.labels, values)))
