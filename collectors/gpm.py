"""GPU Performance Monitoring (GPM) for the gpu collector: SM, tensor, FP-pipe and DRAM activity, PCIe and NVLink
bytes, read from NVML without DCGM (Hopper and newer).

NVML computes each metric between two samples (``nvmlGpmMetricsGet`` on the samples of ``nvmlGpmSampleGet``, or
``nvmlGpmMigSampleGet`` for a MIG GPU instance). :class:`GpmReader` keeps each GPU's (and instance's) last sample
and, at the next scrape, asks for the metrics between it and a new one: the values cover the interval between two
scrapes, as DCGM's profiling fields do. NVML wants the two samples at least 100 ms apart; a scrape sooner than that
keeps the older sample and reports nothing new. The first scrape only takes a sample.

The metric IDs and units are nvml.h's (``nvmlGpmMetricId_t``): the activity metrics are percentages 0-100, reported
here as ratios; PCIe and NVLink are MiB/s, reported as bytes per second.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pynvml

from stagetrace.collectors.base import GAUGE, MetricSpec
from stagetrace.collectors.nvml import NVML_ERRORS, UNSUPPORTED, CachedReads, NvmlSource, error_name

logger = logging.getLogger("stagetrace.collectors.gpu")

GPU_LABELS = ("gpu", "uuid", "model")
# "" for the whole GPU, else the MIG GPU instance ID the values are for
GPM_LABELS = (*GPU_LABELS, "gpu_instance")

SUPPORTED = MetricSpec(
    "gpu_gpm_supported", GAUGE,
    "Whether the GPU has GPU Performance Monitoring (Hopper and newer): the gpu_*_active, gpu_sm_occupancy and "
    "per-second PCIe and NVLink series exist only where it is 1.", GPU_LABELS,
)  # fmt: skip

MIB = 2**20
MIN_INTERVAL_S = 0.1  # NVML's minimum between two GPM samples


def from_percent(value: float) -> float:
    return value / 100


def from_mebibytes(value: float) -> float:
    return value * MIB


@dataclass(frozen=True)
class GpmMetric:
    """One GPM metric: nvml.h's ID, the series it becomes and how NVML's unit becomes the series' base unit."""

    metric_id: int
    spec: MetricSpec
    convert: Callable[[float], float]


def _activity(metric_id: int, name: str, help_text: str) -> GpmMetric:
    return GpmMetric(metric_id, MetricSpec(name, GAUGE, help_text, GPM_LABELS, "ratio"), from_percent)


def _throughput(metric_id: int, name: str, help_text: str) -> GpmMetric:
    return GpmMetric(metric_id, MetricSpec(name, GAUGE, help_text, GPM_LABELS, "bytes_per_second"), from_mebibytes)


_BETWEEN = "between the last two scrapes (NVML GPM)"
GPM_METRICS = (
    _activity(pynvml.NVML_GPM_METRIC_SM_UTIL, "gpu_sm_active_ratio",
              f"Fraction of SMs busy, averaged {_BETWEEN}; DCGM's SM active."),
    _activity(pynvml.NVML_GPM_METRIC_SM_OCCUPANCY, "gpu_sm_occupancy_ratio",
              f"Resident warps against the SMs' theoretical maximum, {_BETWEEN}; DCGM's SM occupancy."),
    _activity(pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL, "gpu_tensor_active_ratio",
              f"Fraction of time the SMs ran any tensor-core instruction, {_BETWEEN}."),
    _activity(pynvml.NVML_GPM_METRIC_HMMA_TENSOR_UTIL, "gpu_tensor_hmma_active_ratio",
              f"Fraction of time the SMs ran half-precision (FP16/BF16) tensor-core instructions, {_BETWEEN}; "
              "DCGM's tensor pipe active."),
    _activity(pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL, "gpu_dram_bandwidth_active_ratio",
              f"Device memory bandwidth used against its theoretical maximum, {_BETWEEN}; DCGM's DRAM active."),
    _activity(pynvml.NVML_GPM_METRIC_FP16_UTIL, "gpu_fp16_active_ratio",
              f"Fraction of time the SMs did non-tensor FP16 math, {_BETWEEN}."),
    _activity(pynvml.NVML_GPM_METRIC_FP32_UTIL, "gpu_fp32_active_ratio",
              f"Fraction of time the SMs did non-tensor FP32 math, {_BETWEEN}."),
    _activity(pynvml.NVML_GPM_METRIC_FP64_UTIL, "gpu_fp64_active_ratio",
              f"Fraction of time the SMs did non-tensor FP64 math, {_BETWEEN}."),
    # gpu_pcie_*_bytes_per_second (no gpm) is NVML's 20 ms window; these average the whole interval
    _throughput(pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC, "gpu_gpm_pcie_transmit_bytes_per_second",
                f"PCIe bytes sent by the GPU per second, {_BETWEEN}."),
    _throughput(pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC, "gpu_gpm_pcie_receive_bytes_per_second",
                f"PCIe bytes received by the GPU per second, {_BETWEEN}."),
    _throughput(pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC, "gpu_nvlink_transmit_bytes_per_second",
                f"NVLink bytes written by the GPU per second over all links, {_BETWEEN}."),
    _throughput(pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC, "gpu_nvlink_receive_bytes_per_second",
                f"NVLink bytes read by the GPU per second over all links, {_BETWEEN}."),
)  # fmt: skip
GPM_METRIC_IDS = tuple(m.metric_id for m in GPM_METRICS)

SUPPORT_CALL = ("nvmlGpmQueryDeviceSupport",)

Pending = list[tuple[MetricSpec, float, dict[str, Any]]]


@dataclass
class _Held:
    sample: Any
    taken_at: float


class GpmReader:
    """Each GPU's GPM samples across scrapes, and the metrics between consecutive ones.

    Errors go through the collector's :class:`CachedReads` (counted, unsupported calls not asked again);
    LOST-class errors propagate, as every reading of a lost GPU does.
    """

    def __init__(self, source: NvmlSource, reads: CachedReads, clock: Callable[[], float]):
        self.source = source
        self.reads = reads
        self.clock = clock
        self._held: dict[tuple[int, int | None], _Held] = {}
        self._refused: set[tuple[int, int]] = set()  # (gpu, metric ID) NVML does not compute on that GPU
        self._support: dict[int, bool] = {}  # asked once a session

    def supported(self, gpu: int) -> bool:
        if gpu not in self._support:
            answer = self.reads.read(gpu, *SUPPORT_CALL)
            if answer is None and not self.reads.unsupported(gpu, *SUPPORT_CALL):
                return False  # a passing error: ask again next scrape
            self._support[gpu] = bool(answer and answer.get("isSupportedDevice"))
        return self._support[gpu]

    def read(self, gpu: int, mig_enabled: bool) -> Pending:
        """The GPM series of one GPU that supports GPM: the whole GPU's, then each MIG GPU instance's."""
        pending: Pending = []
        instances: list[int | None] = [None]
        if mig_enabled:
            instances += self._instances(gpu)
        for key in [k for k in self._held if k[0] == gpu and k[1] not in instances]:
            self._drop(key)  # a GPU instance destroyed since the last scrape
        for instance in instances:
            values = self._interval(gpu, instance)
            label = "" if instance is None else str(instance)
            for metric in GPM_METRICS:
                value = values.get(metric.metric_id)
                if isinstance(value, (int, float)):
                    pending.append((metric.spec, metric.convert(value), {"gpu_instance": label}))
        return pending

    def _instances(self, gpu: int) -> list[int]:
        call = ("nvmlGpmMigSampleGet",)
        if self.reads.unsupported(gpu, *call):
            return []
        try:
            return self.source.gpu_instances(gpu)
        except NVML_ERRORS as exc:
            self.reads.failed(gpu, call, exc)
            return []

    def _interval(self, gpu: int, instance: int | None) -> dict[int, float | str]:
        call = ("nvmlGpmSampleGet",) if instance is None else ("nvmlGpmMigSampleGet", str(instance))
        if self.reads.unsupported(gpu, *call):
            return {}
        key = (gpu, instance)
        held, now = self._held.get(key), self.clock()
        if held is not None and now - held.taken_at < MIN_INTERVAL_S:
            return {}  # too soon for NVML: keep the older sample, so the next interval is long enough
        try:
            newer = self.source.gpm_sample(gpu, instance)
        except NVML_ERRORS as exc:
            self._drop(key)
            self.reads.failed(gpu, call, exc)
            return {}
        self._held[key] = _Held(newer, now)
        if held is None:
            return {}
        try:
            wanted = tuple(i for i in GPM_METRIC_IDS if (gpu, i) not in self._refused)
            values = self.source.gpm_metrics(held.sample, newer, wanted) if wanted else {}
        except NVML_ERRORS as exc:
            self.reads.failed(gpu, ("nvmlGpmMetricsGet",), exc)
            return {}
        finally:
            self._free(held.sample)
        for metric_id, value in values.items():
            if isinstance(value, str):  # NVML's error for this metric alone
                self._metric_failed(gpu, metric_id, value)
        return values

    def _metric_failed(self, gpu: int, metric_id: int, name: str) -> None:
        self.reads.errors[(gpu, "nvmlGpmMetricsGet", name)] += 1
        if name in UNSUPPORTED:  # a metric the GPU does not compute: not asked again
            self._refused.add((gpu, metric_id))
            logger.debug("gpu %d: GPM metric %d: %s; not asked again until NVML is re-initialised",
                         gpu, metric_id, name)

    def _drop(self, key: tuple[int, int | None]) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self._free(held.sample)

    def _free(self, sample: Any) -> None:
        try:
            self.source.gpm_free(sample)
        except NVML_ERRORS as exc:
            logger.debug("nvmlGpmSampleFree: %s", error_name(exc))

    def forget(self) -> None:
        """Before NVML is shut down: free every held sample and ask everything again in the next session."""
        for key in list(self._held):
            self._drop(key)
        self._refused.clear()
        self._support.clear()
