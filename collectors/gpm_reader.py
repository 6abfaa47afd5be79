"""GPU Performance Monitoring (GPM) for the gpu collector: the series of ``stagetrace.gpm_metrics`` read from NVML without DCGM
(Hopper and newer).

NVML computes each metric between two samples (``nvmlGpmMetricsGet`` on the samples of ``nvmlGpmSampleGet``, or
``nvmlGpmMigSampleGet`` for a MIG GPU instance). :class:`GpmReader` keeps each GPU's (and instance's) last sample
and, at the next scrape, asks for the metrics between it and a new one: the values cover the interval between two
scrapes, as DCGM's profiling fields do. NVML wants the two samples at least 100 ms apart; a scrape sooner than that
keeps the older sample and reports nothing new. The first scrape only takes a sample.

Apart from the series table so that reading the table (``stagetrace trace``, the dashboards) loads neither pynvml
nor the collectors' NVML layer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stagetrace.collectors.base import MetricSpec
from stagetrace.gpm_metrics import GPM_METRIC_IDS, GPM_METRICS
from stagetrace.collectors.nvml import NVML_ERRORS, UNSUPPORTED, CachedReads, NvmlSource, error_name

logger = logging.getLogger("stagetrace.collectors.gpu")

MIN_INTERVAL_S = 0.1  # NVML's minimum between two GPM samples
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
            logger.debug(
                "gpu %d: GPM metric %d: %s; not asked again until NVML is re-initialised", gpu, metric_id, name
            )

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
