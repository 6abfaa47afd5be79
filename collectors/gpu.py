"""GPU collector: NVML through nvidia-ml-py (module ``pynvml``), or recorded NVML snapshots.

The collector reads through the source seam in :mod:`stagetrace.nvml` (the real library,
or recorded snapshots in NVML's own shapes, whose format is described there); it alone converts units
and decides what an error means:

- ``NVMLError_NotSupported`` and its kin: the field is dropped for that GPU and not asked again until
  NVML is re-initialised.
- ``NVMLError_GpuIsLost`` / ``ResetRequired`` / ``Unknown`` (and library-level errors after a good
  start): ``gpu_up 0`` for the GPU, its XID counts kept, the handle left alone, and NVML
  re-initialised with back-off (5 s doubling to 5 min). GPUs seen once keep reporting ``gpu_up 0``
  while NVML no longer lists them (fell off the bus) instead of vanishing.
- No library or driver at all (``NVMLError_LibraryNotFound``, ``DriverNotLoaded``): raise
  :class:`SourceUnavailable` with a one-line reason.

Every error NVML answers a per-GPU call with is counted in ``gpu_nvml_errors_total{function, error}``; none fails
the scrape. GPM activity (SM, tensor, FP pipes, DRAM, PCIe and NVLink bytes) comes from :mod:`.gpm` on GPUs that
have it (``gpu_gpm_supported``); each GPU's processes and the pods they belong to from :mod:`.gpu_tenants`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

from stagetrace.collectors.base import (
    COUNTER,
    GAUGE,
    INFO,
    Collector,
    MetricSpec,
    Options,
    Samples,
    SourceUnavailable,
    register,
)
from stagetrace.collectors.gpm_reader import SUPPORT_CALL, GpmReader
from stagetrace.collectors.gpu_tenants import KUBELET_LOG_DIR, PROCFS, PodNames, ProcessOwners, tenant_samples
from stagetrace.collectors.nvml import (
    NVML_FIXTURE,
    SYSTEM_CALLS,
    NVML_ERRORS,
    CachedReads,
    NvmlSource,
    driver_versions,
    error_name,
    nvml_source,
    unavailable_reason,
    write_nvml_fixture,
)
from stagetrace.gpm_metrics import GPM_METRIC_IDS, SUPPORTED

logger = logging.getLogger("stagetrace.collectors.gpu")

# ---------------------------------------------------------------------------------------------
# Metrics, described as data

GPU_LABELS = ("gpu", "uuid", "model")

UP = MetricSpec(
    "gpu_up", GAUGE, "Whether NVML answers for the GPU (0: lost, fallen off the bus, or needs a reset).", GPU_LABELS
)
# The host's inventory, as node_exporter's node_uname_info: what changes a GPU's numerics besides its model, so that
# the analysis can name it for spans whose process recorded no configuration (joined by host and uuid).
INFO_SPEC = MetricSpec(
    "gpu_info",
    INFO,
    "The GPU's driver and CUDA versions and the modes that change its numerics (ECC, MIG).",
    GPU_LABELS,
)
INVENTORY_CALLS = ("nvmlDeviceGetEccMode", "nvmlDeviceGetMigMode")  # each answers (current, pending)
# Ratios, not NVML's percent: Prometheus' base unit, and they aggregate with the other ratios.
UTILIZATION = MetricSpec(
    "gpu_utilization_ratio",
    GAUGE,
    "Fraction of the last sample period in which a kernel ran on the GPU.",
    GPU_LABELS,
    "ratio",
)
MEMORY_COPY_UTILIZATION = MetricSpec(
    "gpu_memory_copy_utilization_ratio",
    GAUGE,
    "Fraction of the last sample period in which device memory was read or written.",
    GPU_LABELS,
    "ratio",
)
MEMORY_USED = MetricSpec(
    "gpu_memory_used_bytes",
    GAUGE,
    "Device memory allocated (NVML used, reserved memory excluded).",
    GPU_LABELS,
    "bytes",
)
MEMORY_TOTAL = MetricSpec("gpu_memory_total_bytes", GAUGE, "Device memory in total.", GPU_LABELS, "bytes")
MEMORY_RESERVED = MetricSpec(
    "gpu_memory_reserved_bytes", GAUGE, "Device memory reserved by the driver and firmware.", GPU_LABELS, "bytes"
)
POWER = MetricSpec("gpu_power_watts", GAUGE, "Power draw (averaged over 1 s on Ampere and newer).", GPU_LABELS, "watts")
ENERGY = MetricSpec(
    "gpu_energy_joules_total", COUNTER, "Energy consumed since the driver was loaded.", GPU_LABELS, "joules"
)
TEMPERATURE = MetricSpec("gpu_temperature_celsius", GAUGE, "GPU die temperature.", GPU_LABELS, "celsius")
SM_CLOCK = MetricSpec("gpu_sm_clock_hertz", GAUGE, "Current SM clock.", GPU_LABELS, "hertz")
MEMORY_CLOCK = MetricSpec("gpu_memory_clock_hertz", GAUGE, "Current memory clock.", GPU_LABELS, "hertz")
CLOCK_EVENT = MetricSpec(
    "gpu_clock_event_active",
    GAUGE,
    "Whether this reason is currently holding the clocks down (NVML clock-event reasons).",
    (*GPU_LABELS, "reason"),
)
# Volatile counts: they reset with the driver like any counter; aggregate ones live in the InfoROM.
ECC_ERRORS = MetricSpec(
    "gpu_ecc_errors_total", COUNTER, "Memory ECC errors since the driver was loaded (volatile).", (*GPU_LABELS, "type")
)
PCIE_TRANSMIT = MetricSpec(
    "gpu_pcie_transmit_bytes_per_second",
    GAUGE,
    "PCIe transmit throughput over NVML's last 20 ms window.",
    GPU_LABELS,
    "bytes_per_second",
)
PCIE_RECEIVE = MetricSpec(
    "gpu_pcie_receive_bytes_per_second",
    GAUGE,
    "PCIe receive throughput over NVML's last 20 ms window.",
    GPU_LABELS,
    "bytes_per_second",
)
NVLINK_TRANSMIT = MetricSpec(
    "gpu_nvlink_transmit_bytes_total",
    COUNTER,
    "NVLink payload bytes transmitted on the link.",
    (*GPU_LABELS, "link"),
    "bytes",
)
NVLINK_RECEIVE = MetricSpec(
    "gpu_nvlink_receive_bytes_total",
    COUNTER,
    "NVLink payload bytes received on the link.",
    (*GPU_LABELS, "link"),
    "bytes",
)
PROCESS_MEMORY = MetricSpec(
    "gpu_process_memory_used_bytes", GAUGE, "Device memory used by a compute process.", (*GPU_LABELS, "pid"), "bytes"
)
XID_ERRORS = MetricSpec(
    "gpu_xid_errors_total", COUNTER, "XID critical-error events since the collector started.", (*GPU_LABELS, "xid")
)
NVML_ERROR_COUNT = MetricSpec(
    "gpu_nvml_errors_total",
    COUNTER,
    "Errors NVML answered a call for this GPU with, by function and NVML error (NotSupported: once, not asked again).",
    (*GPU_LABELS, "function", "error"),
)

# nvmlClocksEventReason* bits, by the label they get (the constant's name in snake case).
CLOCK_EVENT_REASONS = {
    "gpu_idle": pynvml.nvmlClocksEventReasonGpuIdle,
    "applications_clocks_setting": pynvml.nvmlClocksEventReasonApplicationsClocksSetting,
    "sw_power_cap": pynvml.nvmlClocksEventReasonSwPowerCap,
    "hw_slowdown": pynvml.nvmlClocksEventReasonHwSlowdown,
    "sync_boost": pynvml.nvmlClocksEventReasonSyncBoost,
    "sw_thermal_slowdown": pynvml.nvmlClocksEventReasonSwThermalSlowdown,
    "hw_thermal_slowdown": pynvml.nvmlClocksEventReasonHwThermalSlowdown,
    "hw_power_brake_slowdown": pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown,
    "display_clock_setting": pynvml.nvmlClocksEventReasonDisplayClockSetting,
}

Add = Callable[..., None]  # add(spec, value, **extra_labels): one sample of the GPU being read


@dataclass(frozen=True)
class Reading:
    """One NVML call (function and constant arguments) and how its answer becomes samples."""

    call: tuple[str, ...]
    emit: Callable[[Any, Add], None]


def converted(spec: MetricSpec, convert: Callable[[float], float], **labels) -> Callable[[Any, Add], None]:
    return lambda value, add: add(spec, convert(value), **labels)


def from_milli(value):
    return value / 1000


def from_mega(value):
    return value * 1_000_000


def from_kibi(value):  # NVML's "KB" (PCIe) and "KiB" (NVLink) are both 1024 bytes
    return value * 1024


def as_is(value):
    return value


def _utilization(rates, add: Add) -> None:
    add(UTILIZATION, rates["gpu"] / 100)
    add(MEMORY_COPY_UTILIZATION, rates["memory"] / 100)


def _memory(info, add: Add) -> None:
    add(MEMORY_USED, info["used"])
    add(MEMORY_TOTAL, info["total"])
    if "reserved" in info:  # nvmlMemory_v2_t only
        add(MEMORY_RESERVED, info["reserved"])


def _clock_events(mask: int, add: Add) -> None:
    for reason, bit in CLOCK_EVENT_REASONS.items():
        add(CLOCK_EVENT, 1 if mask & bit else 0, reason=reason)


def per_link(spec: MetricSpec) -> Callable[[Any, Add], None]:
    def emit(values, add: Add) -> None:
        for link, kib in enumerate(values):
            if kib is not None:  # NVML answered this link with an error
                add(spec, from_kibi(kib), link=link)

    return emit


def _process_memory(processes, add: Add) -> None:
    for process in processes:
        if process["usedGpuMemory"] is not None:  # not available (e.g. without permission)
            add(PROCESS_MEMORY, process["usedGpuMemory"], pid=process["pid"])


READINGS = (
    Reading(("nvmlDeviceGetUtilizationRates",), _utilization),
    Reading(("nvmlDeviceGetMemoryInfo",), _memory),
    Reading(("nvmlDeviceGetPowerUsage",), converted(POWER, from_milli)),
    Reading(("nvmlDeviceGetTotalEnergyConsumption",), converted(ENERGY, from_milli)),
    Reading(("nvmlDeviceGetTemperatureV", "NVML_TEMPERATURE_GPU"), converted(TEMPERATURE, as_is)),
    Reading(("nvmlDeviceGetClockInfo", "NVML_CLOCK_SM"), converted(SM_CLOCK, from_mega)),
    Reading(("nvmlDeviceGetClockInfo", "NVML_CLOCK_MEM"), converted(MEMORY_CLOCK, from_mega)),
    Reading(("nvmlDeviceGetCurrentClocksEventReasons",), _clock_events),
    Reading(
        ("nvmlDeviceGetTotalEccErrors", "NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_VOLATILE_ECC"),
        converted(ECC_ERRORS, as_is, type="corrected"),
    ),
    Reading(
        ("nvmlDeviceGetTotalEccErrors", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC"),
        converted(ECC_ERRORS, as_is, type="uncorrected"),
    ),
    Reading(("nvmlDeviceGetPcieThroughput", "NVML_PCIE_UTIL_TX_BYTES"), converted(PCIE_TRANSMIT, from_kibi)),
    Reading(("nvmlDeviceGetPcieThroughput", "NVML_PCIE_UTIL_RX_BYTES"), converted(PCIE_RECEIVE, from_kibi)),
    Reading(("nvmlDeviceGetFieldValues", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX"), per_link(NVLINK_TRANSMIT)),
    Reading(("nvmlDeviceGetFieldValues", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX"), per_link(NVLINK_RECEIVE)),
    Reading(("nvmlDeviceGetComputeRunningProcesses",), _process_memory),
)


def record_nvml_fixture(source: NvmlSource, directory: Path | str, gpm_interval_s: float = 1.0) -> Path:
    """Snapshot every reading the collectors make from ``source`` (e.g. the real library) into the fixture format;
    on GPUs with GPM, one ``nvmlGpmMetricsGet`` answer between two samples ``gpm_interval_s`` apart."""
    from stagetrace.collectors.mps import NVML_CALLS as MPS_CALLS  # the mps collector's readings

    calls = [
        ("nvmlDeviceGetUUID",),
        ("nvmlDeviceGetName",),
        *(r.call for r in READINGS),
        *MPS_CALLS,
        *((call,) for call in INVENTORY_CALLS),
        SUPPORT_CALL,
    ]
    source.open()
    try:
        system = {}
        for function in SYSTEM_CALLS.values():
            try:
                system[function] = source.system(function)
            except NVML_ERRORS as exc:
                system[function] = error_name(exc)
        gpus = []
        for index in range(source.device_count()):
            device: dict = {"nvmlEventSetWait_v2": []}  # events cannot be read back, only counted
            for function, *constants in dict.fromkeys(calls):
                try:
                    value = source.read(index, function, *constants)
                except NVML_ERRORS as exc:
                    value = error_name(exc)
                node = device
                for key in (function, *constants)[:-1]:
                    node = node.setdefault(key, {})
                node[(function, *constants)[-1]] = value
            gpus.append(device)
        _record_gpm(source, gpus, gpm_interval_s)
    finally:
        source.close()
    return write_nvml_fixture(directory, gpus, **system)


def _record_gpm(source: NvmlSource, gpus: list[dict], interval_s: float) -> None:
    """Add one GPM interval to each recorded GPU that supports GPM, in the shape of nvmlGpmMetricsGet's metrics."""
    codes = {cls.__name__: code for code, cls in pynvml.NVMLError._valClassMapping.items()}
    first = {}
    for index, device in enumerate(gpus):
        if isinstance(device.get(SUPPORT_CALL[0]), dict) and device[SUPPORT_CALL[0]].get("isSupportedDevice"):
            try:
                first[index] = source.gpm_sample(index)
            except NVML_ERRORS as exc:
                device["nvmlGpmMetricsGet"] = error_name(exc)
    if first:
        time.sleep(interval_s)
    for index, older in first.items():
        try:
            newer = source.gpm_sample(index)
            try:
                answers = source.gpm_metrics(older, newer, GPM_METRIC_IDS)
            finally:
                source.gpm_free(newer)
        except NVML_ERRORS as exc:
            gpus[index]["nvmlGpmMetricsGet"] = error_name(exc)
            continue
        finally:
            source.gpm_free(older)
        gpus[index]["nvmlGpmMetricsGet"] = [
            [
                {"metricId": metric_id, "nvmlReturn": codes.get(value, pynvml.NVML_ERROR_UNKNOWN), "value": 0.0}
                if isinstance(value, str)
                else {"metricId": metric_id, "nvmlReturn": pynvml.NVML_SUCCESS, "value": value}
                for metric_id, value in answers.items()
            ]
        ]


# ---------------------------------------------------------------------------------------------
# The collector


@dataclass(frozen=True)
class GpuIdentity:
    gpu: int
    uuid: str = ""
    model: str = ""

    def labels(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "uuid": self.uuid, "model": self.model}


BACKOFF_FIRST_S = 5.0
BACKOFF_MAX_S = 300.0


@register
class GpuCollector(Collector):
    """NVIDIA GPUs through NVML: one set of ``gpu_*`` series per GPU, labelled gpu, uuid, model."""

    name = "gpu"
    settings = (NVML_FIXTURE, PROCFS, KUBELET_LOG_DIR)

    def __init__(
        self, options: Options, *, source: NvmlSource | None = None, clock: Callable[[], float] = time.monotonic
    ):
        super().__init__(options)
        self.source = source if source is not None else nvml_source(options)
        self._reads = CachedReads(self.source)
        self._gpm = GpmReader(self.source, self._reads, clock)
        self._owners = ProcessOwners(options.procfs, PodNames(options.kubelet_log_dir))
        self._clock = clock
        self._open = False
        self._known: dict[str, GpuIdentity] = {}  # every GPU seen since start, by UUID
        self._identities: dict[int, GpuIdentity] = {}  # this NVML session's, by index
        self._lost: set[int] = set()  # this NVML session's lost GPUs: not asked again until re-init
        self._reinit_at: float | None = None
        self._backoff = BACKOFF_FIRST_S
        self._system: dict[str, str] | None = None  # the driver's versions, asked once a session

    def collect(self, out: Samples) -> None:
        try:
            self._open_session()
            count = self.source.device_count() if self._open else 0
        except (SourceUnavailable, *NVML_ERRORS) as exc:
            if not self._known:  # never saw a GPU: the source is simply not here
                raise SourceUnavailable(unavailable_reason(exc)) from None
            self._session_lost(exc)
            count = 0
        self._owners.begin()
        reported = {self._collect_gpu(index, out).uuid for index in range(count)}
        self._owners.end()
        for identity in self._known.values():
            if identity.uuid not in reported:
                out.add(UP, 0, **identity.labels())
        for (gpu, uuid, xid), n in sorted(self.source.xid_counts().items()):
            identity = self._known.get(uuid, GpuIdentity(gpu, uuid))
            out.add(XID_ERRORS, n, **identity.labels(), xid=xid)
        for (gpu, function, error), n in sorted(self._reads.errors.items()):
            out.add(NVML_ERROR_COUNT, n, **self._last_identity(gpu).labels(), function=function, error=error)
        if count and not self._lost:
            self._backoff = BACKOFF_FIRST_S

    def _open_session(self) -> None:
        if self._reinit_at is not None:
            if self._clock() < self._reinit_at:
                return
            logger.info("gpu: re-initialising NVML")
            self._close_session()
            self._reinit_at = None
        if not self._open:
            self.source.open()
            self._open = True

    def _close_session(self) -> None:
        if self._open:
            self._gpm.forget()  # its samples are NVML's: free them before NVML shuts down
            self.source.close()
        self._open = False
        self._identities.clear()
        self._lost.clear()
        self._reads.forget()
        self._system = None

    def _schedule_reinit(self) -> float:
        if self._reinit_at is None:
            self._reinit_at = self._clock() + self._backoff
            self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
        return self._reinit_at - self._clock()

    def _session_lost(self, exc: BaseException) -> None:
        was_open = self._open
        self._close_session()
        delay = self._schedule_reinit()
        if was_open:
            logger.warning(
                "gpu: NVML failed (%s); every GPU reports gpu_up 0, re-initialising in %.0fs", error_name(exc), delay
            )

    def _collect_gpu(self, index: int, out: Samples) -> GpuIdentity:
        if index in self._lost:
            identity = self._last_identity(index)
            out.add(UP, 0, **identity.labels())
            return identity
        pending: list[tuple[MetricSpec, float, dict]] = []
        try:
            identity = self._identify(index)
            inventory = self._inventory(index)  # inside: a GPU lost while it answers is that GPU lost
            answers = {}
            for reading in READINGS:
                value = answers[reading.call] = self._reads.read(index, *reading.call)
                if value is not None:
                    reading.emit(value, lambda spec, v, **extra: pending.append((spec, v, extra)))
            pending += self._activity(index, inventory)
            pending += self._tenants(index, answers)
        except NVML_ERRORS as exc:  # LOST-class, or the GPU cannot even say who it is
            identity = self._last_identity(index)
            self._lost.add(index)
            delay = self._schedule_reinit()
            logger.warning(
                "gpu %d (%s): %s; gpu_up 0, re-initialising NVML in %.0fs",
                index,
                identity.uuid or "uuid unknown",
                error_name(exc),
                delay,
            )
            out.add(UP, 0, **identity.labels())
            return identity
        labels = identity.labels()
        out.add(UP, 1, **labels)
        out.add(INFO_SPEC, inventory, **labels)
        for spec, value, extra in pending:
            out.add(spec, value, **labels, **extra)
        return identity

    def _activity(self, index: int, inventory: dict[str, str]) -> list[tuple[MetricSpec, float, dict]]:
        """gpu_gpm_supported, and on a GPU with GPM its activity between the last two scrapes."""
        if not self._gpm.supported(index):
            return [(SUPPORTED, 0, {})]
        return [(SUPPORTED, 1, {}), *self._gpm.read(index, inventory.get("mig_mode") == "enabled")]

    def _tenants(self, index: int, answers: dict) -> list[tuple[MetricSpec, Any, dict]]:
        """The GPU's processes and the pods they belong to."""
        running = answers[("nvmlDeviceGetComputeRunningProcesses",)]
        clients = self._reads.read(index, "nvmlDeviceGetMPSComputeRunningProcesses")
        utilization = self._reads.read(index, "nvmlDeviceGetProcessUtilization") if running or clients else None
        memory = answers[("nvmlDeviceGetMemoryInfo",)]
        return tenant_samples(running, clients, utilization, memory and memory["used"], self._owners)

    def _inventory(self, index: int) -> dict[str, str]:
        """gpu_info's labels: the driver's versions (asked once a session) and the GPU's current ECC and MIG modes."""
        if self._system is None:
            self._system = driver_versions(self.source)
        modes = {}
        for label, call in zip(("ecc_mode", "mig_mode"), INVENTORY_CALLS):
            current = self._reads.read(index, call)  # (current, pending); None where NVML does not say
            if current is not None:
                modes[label] = "enabled" if current[0] else "disabled"
        return {"driver_version": "", "cuda_version": "", **self._system, "ecc_mode": "", "mig_mode": "", **modes}

    def _identify(self, index: int) -> GpuIdentity:
        if index not in self._identities:
            uuid = self.source.read(index, "nvmlDeviceGetUUID")
            identity = GpuIdentity(index, uuid, self.source.read(index, "nvmlDeviceGetName"))
            self._identities[index] = self._known[uuid] = identity
        return self._identities[index]

    def _last_identity(self, index: int) -> GpuIdentity:
        """This session's identity of GPU ``index``, else the last one seen at that index, else index alone."""
        if index in self._identities:
            return self._identities[index]
        seen = [i for i in self._known.values() if i.gpu == index]
        return seen[-1] if seen else GpuIdentity(index)

    def close(self) -> None:
        self._close_session()
