"""The GPU Performance Monitoring (GPM) series the gpu collector reports: SM, tensor, FP-pipe and DRAM activity,
PCIe and NVLink bytes, as data (``GPM_METRICS``). ``collectors/gpm_reader`` samples them from NVML; the analysis and
the dashboards read this table, so it lives in the core beside the metric model, not among the collectors.

The metric IDs and units are nvml.h's (``nvmlGpmMetricId_t``, an ABI NVML keeps): the activity metrics are
percentages 0-100, reported here as ratios; PCIe and NVLink are MiB/s, reported as bytes per second. The IDs are
written out rather than read from pynvml because ``stagetrace trace`` and the dashboards read this table, and they
should load neither pynvml nor the NVML binding (``stagetrace.nvml``) to do so (tests check they equal pynvml's constants).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stagetrace.metrics import GAUGE, MetricSpec

GPU_LABELS = ("gpu", "uuid", "model")
# "" for the whole GPU, else the MIG GPU instance ID the values are for
GPM_LABELS = (*GPU_LABELS, "gpu_instance")

SUPPORTED = MetricSpec(
    "gpu_gpm_supported",
    GAUGE,
    "Whether the GPU has GPU Performance Monitoring (Hopper and newer): the gpu_*_active, gpu_sm_occupancy and "
    "per-second PCIe and NVLink series exist only where it is 1.",
    GPU_LABELS,
)

MIB = 2**20


def from_percent(value: float) -> float:
    return value / 100


def from_mebibytes(value: float) -> float:
    return value * MIB


# nvml.h's nvmlGpmMetricId_t values (pynvml's NVML_GPM_METRIC_* constants)
NVML_GPM_METRIC_SM_UTIL = 2
NVML_GPM_METRIC_SM_OCCUPANCY = 3
NVML_GPM_METRIC_ANY_TENSOR_UTIL = 5
NVML_GPM_METRIC_HMMA_TENSOR_UTIL = 7
NVML_GPM_METRIC_DRAM_BW_UTIL = 10
NVML_GPM_METRIC_FP64_UTIL = 11
NVML_GPM_METRIC_FP32_UTIL = 12
NVML_GPM_METRIC_FP16_UTIL = 13
NVML_GPM_METRIC_PCIE_TX_PER_SEC = 20
NVML_GPM_METRIC_PCIE_RX_PER_SEC = 21
NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC = 60
NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC = 61


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
    _activity(
        NVML_GPM_METRIC_SM_UTIL, "gpu_sm_active_ratio", f"Fraction of SMs busy, averaged {_BETWEEN}; DCGM's SM active."
    ),
    _activity(
        NVML_GPM_METRIC_SM_OCCUPANCY,
        "gpu_sm_occupancy_ratio",
        f"Resident warps against the SMs' theoretical maximum, {_BETWEEN}; DCGM's SM occupancy.",
    ),
    _activity(
        NVML_GPM_METRIC_ANY_TENSOR_UTIL,
        "gpu_tensor_active_ratio",
        f"Fraction of time the SMs ran any tensor-core instruction, {_BETWEEN}.",
    ),
    _activity(
        NVML_GPM_METRIC_HMMA_TENSOR_UTIL,
        "gpu_tensor_hmma_active_ratio",
        f"Fraction of time the SMs ran half-precision (FP16/BF16) tensor-core instructions, {_BETWEEN}; "
        "DCGM's tensor pipe active.",
    ),
    _activity(
        NVML_GPM_METRIC_DRAM_BW_UTIL,
        "gpu_dram_bandwidth_active_ratio",
        f"Device memory bandwidth used against its theoretical maximum, {_BETWEEN}; DCGM's DRAM active.",
    ),
    _activity(
        NVML_GPM_METRIC_FP16_UTIL,
        "gpu_fp16_active_ratio",
        f"Fraction of time the SMs did non-tensor FP16 math, {_BETWEEN}.",
    ),
    _activity(
        NVML_GPM_METRIC_FP32_UTIL,
        "gpu_fp32_active_ratio",
        f"Fraction of time the SMs did non-tensor FP32 math, {_BETWEEN}.",
    ),
    _activity(
        NVML_GPM_METRIC_FP64_UTIL,
        "gpu_fp64_active_ratio",
        f"Fraction of time the SMs did non-tensor FP64 math, {_BETWEEN}.",
    ),
    # gpu_pcie_*_bytes_per_second (no gpm) is NVML's 20 ms window; these average the whole interval
    _throughput(
        NVML_GPM_METRIC_PCIE_TX_PER_SEC,
        "gpu_gpm_pcie_transmit_bytes_per_second",
        f"PCIe bytes sent by the GPU per second, {_BETWEEN}.",
    ),
    _throughput(
        NVML_GPM_METRIC_PCIE_RX_PER_SEC,
        "gpu_gpm_pcie_receive_bytes_per_second",
        f"PCIe bytes received by the GPU per second, {_BETWEEN}.",
    ),
    _throughput(
        NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC,
        "gpu_nvlink_transmit_bytes_per_second",
        f"NVLink bytes written by the GPU per second over all links, {_BETWEEN}.",
    ),
    _throughput(
        NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC,
        "gpu_nvlink_receive_bytes_per_second",
        f"NVLink bytes read by the GPU per second over all links, {_BETWEEN}.",
    ),
)
GPM_METRIC_IDS = tuple(m.metric_id for m in GPM_METRICS)

__all__ = [
    "GPM_LABELS",
    "GPM_METRICS",
    "GPM_METRIC_IDS",
    "GPU_LABELS",
    "MIB",
    "SUPPORTED",
    "GpmMetric",
    "from_mebibytes",
    "from_percent",
    *(name for name in dir() if name.startswith("NVML_GPM_METRIC_")),
]
