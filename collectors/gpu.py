"""GPU collector: NVML through nvidia-ml-py (module ``pynvml``), or recorded NVML snapshots.

The collector reads through a small source seam, :class:`NvmlSource`, with two implementations:
:class:`PynvmlSource` calls the real library (and counts XID events on its own thread), and
:class:`FixtureSource` answers from a snapshot written in NVML's own shapes, for tests and the demo
on machines without a GPU (node_exporter's wifi/qdisc ``*.fixtures`` pattern). Both answer
``read(gpu, function, *constants)`` with what the pynvml call returns, as plain data, and raise
pynvml's own exceptions; the collector alone converts units and decides what an error means:

- ``NVMLError_NotSupported`` and its kin: the field is dropped for that GPU and not asked again until
  NVML is re-initialised.
- ``NVMLError_GpuIsLost`` / ``ResetRequired`` / ``Unknown`` (and library-level errors after a good
  start): ``gpu_up 0`` for the GPU, its XID counts kept, the handle left alone, and NVML
  re-initialised with back-off (5 s doubling to 5 min). GPUs seen once keep reporting ``gpu_up 0``
  while NVML no longer lists them (fell off the bus) instead of vanishing.
- No library or driver at all (``NVMLError_LibraryNotFound``, ``DriverNotLoaded``): raise
  :class:`SourceUnavailable` with a one-line reason.

Fixture format: ``<Options.nvml_fixture>/nvml.json`` (see :func:`write_nvml_fixture`)::

    {"nvmlSystemGetDriverVersion": "570.133.20",
     "gpus": [                                    # list position = NVML index
       {"nvmlDeviceGetUUID": "GPU-…", "nvmlDeviceGetName": "NVIDIA H200",
        "nvmlDeviceGetUtilizationRates": {"gpu": 93, "memory": 51},             # percent
        "nvmlDeviceGetMemoryInfo": {"version": 33554472, "total": …, "reserved": …, "free": …, "used": …},
        "nvmlDeviceGetPowerUsage": 612345,                                      # mW
        "nvmlDeviceGetTotalEnergyConsumption": 41234567890,                     # mJ
        "nvmlDeviceGetTemperatureV": {"NVML_TEMPERATURE_GPU": 54},              # °C
        "nvmlDeviceGetClockInfo": {"NVML_CLOCK_SM": 1980, "NVML_CLOCK_MEM": 3201},   # MHz
        "nvmlDeviceGetCurrentClocksEventReasons": 32,                          # bitmask
        "nvmlDeviceGetTotalEccErrors": {"NVML_MEMORY_ERROR_TYPE_CORRECTED": {"NVML_VOLATILE_ECC": 0}, …},
        "nvmlDeviceGetPcieThroughput": {"NVML_PCIE_UTIL_TX_BYTES": 1200, …},   # KB/s
        "nvmlDeviceGetFieldValues": {"NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX": [KiB, …]},  # by link (scopeId)
        "nvmlDeviceGetComputeRunningProcesses": [{"pid": 6001, "usedGpuMemory": …,     # bytes, or null
                                                  "gpuInstanceId": …, "computeInstanceId": …}],
        "nvmlDeviceGetMPSComputeRunningProcesses": [… same shape …],
        "nvmlDeviceGetProcessUtilization": [{"pid": …, "timeStamp": µs, "smUtil": %, "memUtil": %,
                                             "encUtil": %, "decUtil": %}],
        "nvmlEventSetWait_v2": [{"eventType": 8, "eventData": 48, "gpuInstanceId": …, "computeInstanceId": …}]}]}

Each key is a pynvml function; its value is what the call returns, structs as objects with the C field
names. A call that takes constants nests one object per argument, keyed by the pynvml constant's name.
``"NVMLError_<Name>"`` in place of any value raises that exception (a missing key reads as
``NVMLError_NotSupported``); ``"nvmlDeviceGetHandleByIndex": "NVMLError_GpuIsLost"`` makes every call
for that GPU fail so; top-level ``"nvmlInit"`` / ``"nvmlDeviceGetCount"`` may hold an error too.
``nvmlEventSetWait_v2`` lists every event recorded since start (eventType 8 =
``nvmlEventTypeXidCriticalError``, eventData = the XID); ``null`` in a per-link list is a link NVML
answered with an error. The file is read again at each scrape, so a writer may advance it; use
:func:`write_nvml_fixture` (atomic replace) and :func:`gpu_snapshot` for an idle GPU to start from.
:func:`record_nvml_fixture` writes the same format from any source, the real library included.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pynvml
from stagetrace.collectors.base import (
    COUNTER,
    GAUGE,
    Collector,
    MetricSpec,
    Options,
    Samples,
    SourceUnavailable,
    register,
)

logger = logging.getLogger("stagetrace.collectors.gpu")

SNAPSHOT_FILE = "nvml.json"

# ---------------------------------------------------------------------------------------------
# Metrics, described as data

GPU_LABELS = ("gpu", "uuid", "model")

UP = MetricSpec(
    "gpu_up", GAUGE, "Whether NVML answers for the GPU (0: lost, fallen off the bus, or needs a reset).", GPU_LABELS
)
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

# ---------------------------------------------------------------------------------------------
# What NVML errors mean (by class name: the names the fixture uses, stable across pynvml versions)

# NVMLLibraryMismatchError (not an NVMLError) exists from nvidia-ml-py 12.550 on
NVML_ERRORS: tuple[type[Exception], ...] = tuple(
    filter(None, (pynvml.NVMLError, getattr(pynvml, "NVMLLibraryMismatchError", None)))
)

UNSUPPORTED = {  # asking again will not help
    "NVMLError_NotSupported",
    "NVMLError_FunctionNotFound",
    "NVMLLibraryMismatchError",
    "NVMLError_NoPermission",
    "NVMLError_InvalidArgument",
    "NVMLError_ArgumentVersionMismatch",
    "NVMLError_Deprecated",
}
LOST = {  # the GPU or the whole NVML session is gone: gpu_up 0, re-initialise
    "NVMLError_GpuIsLost",
    "NVMLError_ResetRequired",
    "NVMLError_Unknown",
    "NVMLError_GpuNotFound",
    "NVMLError_Uninitialized",
    "NVMLError_DriverNotLoaded",
    "NVMLError_LibRmVersionMismatch",
}


def error_name(exc: BaseException) -> str:
    return type(exc).__name__


def unavailable_reason(exc: BaseException) -> str:
    """One line saying why NVML cannot be used on this host, and what to do about it."""
    name = error_name(exc)
    if not isinstance(exc, NVML_ERRORS):
        return str(exc)
    return {
        "NVMLError_LibraryNotFound": "NVML library libnvidia-ml.so.1 not found: no NVIDIA driver on this host",
        "NVMLError_DriverNotLoaded": f"NVIDIA kernel driver not loaded ({name}): load the nvidia module",
        "NVMLError_NoPermission": f"no permission to open /dev/nvidia* ({name})",
        "NVMLError_LibRmVersionMismatch": f"NVML library and driver versions differ ({name}): reload nvidia",
    }.get(name, f"NVML unavailable: {name}")


def nvml_error(name: str) -> Exception:
    """The pynvml exception a snapshot names, e.g. ``NVMLError_NotSupported``."""
    cls = getattr(pynvml, name, None)
    if not (isinstance(cls, type) and issubclass(cls, NVML_ERRORS)):
        raise ValueError(f"NVML snapshot names an unknown error {name!r}")
    return cls() if issubclass(cls, pynvml.NVMLError) else cls(name)


# ---------------------------------------------------------------------------------------------
# The source seam


class NvmlSource(Protocol):
    """What the gpu and mps collectors ask NVML."""

    def open(self) -> None:
        """Initialise NVML; raise SourceUnavailable (one-line reason) when it cannot be used here."""

    def close(self) -> None: ...

    def device_count(self) -> int: ...

    def read(self, gpu: int, function: str, *constants: str) -> Any:
        """What ``pynvml.<function>(handle of gpu, *constants)`` returns, as plain data; raises pynvml errors."""

    def xid_counts(self) -> Mapping[tuple[int, str, int], int]:
        """XID critical-error events seen since the source was created, by (gpu index, uuid, xid)."""


def nvml_source(options: Options, watch_xids: bool = True) -> NvmlSource:
    """The recorded snapshot when ``Options.nvml_fixture`` is set, else the real library."""
    return FixtureSource(options.nvml_fixture) if options.nvml_fixture else PynvmlSource(watch_xids=watch_xids)


def plain(value: Any) -> Any:
    """A pynvml answer as JSON-able data: structs become dicts keyed by their C field names."""
    if isinstance(value, (list, tuple, ctypes.Array)):
        return [plain(v) for v in value]
    if isinstance(value, pynvml.nvmlFriendlyObject):
        return {k: plain(v) for k, v in vars(value).items()}
    if isinstance(value, ctypes.Structure):
        return {name: plain(getattr(value, name)) for name, *_ in value._fields_}
    if isinstance(value, bytes):
        return value.decode()
    return value


# The union member a c_nvmlFieldValue_t's value is read from, by its valueType (NVML_VALUE_TYPE_*).
_FIELD_VALUE_MEMBER = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")
# Older drivers lack the newer functions; the deprecated ones answer the same question.
_OLDER_FUNCTION = {
    "nvmlDeviceGetTemperatureV": "nvmlDeviceGetTemperature",
    "nvmlDeviceGetCurrentClocksEventReasons": "nvmlDeviceGetCurrentClocksThrottleReasons",
}
XID_WAIT_MS = 500  # how long one nvmlEventSetWait_v2 blocks; also bounds how long close() waits


class PynvmlSource:
    """The real NVML, through nvidia-ml-py. ``nvml`` is the pynvml module (a parameter only for tests);
    without ``watch_xids`` no event thread runs and ``xid_counts`` stays empty."""

    def __init__(self, nvml=pynvml, watch_xids: bool = True):
        self.nvml = nvml
        self.watch_xids = watch_xids
        self._handles: dict[int, Any] = {}
        self._utilization_seen: dict[int, int] = {}  # last process-utilization timestamp (µs) per GPU
        self._xids: Counter[tuple[int, str, int]] = Counter()
        self._xid_lock = threading.Lock()
        self._watcher: XidWatcher | None = None

    def open(self) -> None:
        try:
            self.nvml.nvmlInit()
        except NVML_ERRORS as exc:
            raise SourceUnavailable(unavailable_reason(exc)) from None
        self._handles.clear()
        if self.watch_xids:
            self._watcher = XidWatcher(self.nvml, self._count_xid)
            self._watcher.start()

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        try:
            self.nvml.nvmlShutdown()
        except NVML_ERRORS:
            pass  # already gone: nothing left to release

    def device_count(self) -> int:
        return self.nvml.nvmlDeviceGetCount()

    def _handle(self, gpu: int):
        if gpu not in self._handles:
            self._handles[gpu] = self.nvml.nvmlDeviceGetHandleByIndex(gpu)
        return self._handles[gpu]

    def read(self, gpu: int, function: str, *constants: str) -> Any:
        handle = self._handle(gpu)
        if function == "nvmlDeviceGetMemoryInfo":
            return self._memory_info(handle)
        if function == "nvmlDeviceGetFieldValues":
            return self._per_link_field(handle, *constants)
        if function == "nvmlDeviceGetProcessUtilization":
            return self._process_utilization(gpu, handle)
        args = [getattr(self.nvml, c) for c in constants]
        older = getattr(self.nvml, _OLDER_FUNCTION.get(function, ""), None)
        call = getattr(self.nvml, function, None) or older  # an older nvidia-ml-py may not wrap it yet
        if call is None:
            raise self.nvml.NVMLError_FunctionNotFound()
        try:
            return plain(call(handle, *args))
        except self.nvml.NVMLError_FunctionNotFound:  # the driver lacks it
            if older is None or call is older:
                raise
            return plain(older(handle, *args))

    def _memory_info(self, handle) -> dict:
        try:  # v2 tells reserved memory apart, as nvidia-smi does since R525
            return plain(self.nvml.nvmlDeviceGetMemoryInfo(handle, version=self.nvml.nvmlMemory_v2))
        except (self.nvml.NVMLError_FunctionNotFound, self.nvml.NVMLError_ArgumentVersionMismatch):
            return plain(self.nvml.nvmlDeviceGetMemoryInfo(handle))

    def _per_link_field(self, handle, field: str) -> list:
        field_id = getattr(self.nvml, field)
        values = self.nvml.nvmlDeviceGetFieldValues(
            handle, [(field_id, link) for link in range(self.nvml.NVML_NVLINK_MAX_LINKS)]
        )
        answers = [
            getattr(v.value, _FIELD_VALUE_MEMBER[v.valueType]) if v.nvmlReturn == self.nvml.NVML_SUCCESS else None
            for v in values
        ]
        while answers and answers[-1] is None:  # links past the GPU's last one
            answers.pop()
        if not answers:
            raise self.nvml.NVMLError(values[0].nvmlReturn if len(values) else self.nvml.NVML_ERROR_NOT_SUPPORTED)
        return answers

    def _process_utilization(self, gpu: int, handle) -> list[dict]:
        try:  # samples since the last ones seen (0: everything the driver still holds)
            samples = plain(self.nvml.nvmlDeviceGetProcessUtilization(handle, self._utilization_seen.get(gpu, 0)))
        except self.nvml.NVMLError_NotFound:
            return []  # NVML's way of saying "no new samples"
        if samples:
            self._utilization_seen[gpu] = max(s["timeStamp"] for s in samples)
        return samples

    def _count_xid(self, gpu: int, uuid: str, xid: int) -> None:
        with self._xid_lock:
            self._xids[(gpu, uuid, xid)] += 1

    def xid_counts(self) -> Mapping[tuple[int, str, int], int]:
        with self._xid_lock:
            return dict(self._xids)


class XidWatcher(threading.Thread):
    """Waits for XID critical-error events on every GPU, on its own thread (the wait blocks).

    The counts live in the source, not here, so they outlive NVML re-initialisations and keep being
    reported while regular collection fails: the GPU throwing XIDs is the one whose readings break.
    """

    def __init__(self, nvml, count: Callable[[int, str, int], None]):
        super().__init__(name="stagetrace-xid-watcher", daemon=True)
        self.nvml = nvml
        self.count = count
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=2 * XID_WAIT_MS / 1000)

    def run(self) -> None:
        backoff = 1.0
        while not self._stopping.is_set():
            try:
                self._watch()
                return  # no GPU takes XID events: nothing to wait for
            except NVML_ERRORS as exc:
                logger.debug("XID watcher: %s; registering again in %.0fs", error_name(exc), backoff)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, 60.0)

    def _watch(self) -> None:
        nv = self.nvml
        event_set = nv.nvmlEventSetCreate()
        try:
            gpus: dict[int | None, tuple[int, str]] = {}  # handle address → (index, uuid)
            for index in range(nv.nvmlDeviceGetCount()):
                try:
                    handle = nv.nvmlDeviceGetHandleByIndex(index)
                    nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, event_set)
                    gpus[_address(handle)] = (index, nv.nvmlDeviceGetUUID(handle))
                except NVML_ERRORS as exc:
                    logger.debug("gpu %d: no XID events (%s)", index, error_name(exc))
            if not gpus:
                return
            while not self._stopping.is_set():
                try:
                    event = nv.nvmlEventSetWait_v2(event_set, XID_WAIT_MS)
                except nv.NVMLError_Timeout:
                    continue
                if event.eventType & nv.nvmlEventTypeXidCriticalError:
                    index, uuid = gpus.get(_address(event.device), (-1, ""))
                    self.count(index, uuid, int(event.eventData))
        finally:
            try:
                nv.nvmlEventSetFree(event_set)
            except NVML_ERRORS:
                pass


def _address(handle) -> int | None:
    """A device handle's identity (handles are pointers; the event carries its own pointer object)."""
    return ctypes.cast(handle, ctypes.c_void_p).value


class FixtureSource:
    """NVML answers from a snapshot in NVML's shapes (module docstring). No GPU exists where tests run,
    so the committed snapshots are written in the shapes the pynvml calls return, as a recording would be."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / SNAPSHOT_FILE
        self._snapshot: dict = {}

    def _load(self) -> dict:
        try:
            self._snapshot = json.loads(self.path.read_text())
        except FileNotFoundError:
            raise SourceUnavailable(f"no NVML snapshot at {self.path}") from None
        return self._snapshot

    def open(self) -> None:
        answer = self._load().get("nvmlInit")
        if isinstance(answer, str):
            raise SourceUnavailable(unavailable_reason(nvml_error(answer)))

    def close(self) -> None:
        pass

    def device_count(self) -> int:
        snapshot = self._load()  # each scrape starts here: pick up what the writer advanced
        _raise_if_error(snapshot.get("nvmlDeviceGetCount"))
        return len(snapshot["gpus"])

    def read(self, gpu: int, function: str, *constants: str) -> Any:
        device = self._snapshot["gpus"][gpu]
        _raise_if_error(device.get("nvmlDeviceGetHandleByIndex"))
        value = device.get(function, "NVMLError_NotSupported")
        for constant in constants:
            _raise_if_error(value)
            value = value.get(constant, "NVMLError_NotSupported")
        _raise_if_error(value)
        return value

    def xid_counts(self) -> Mapping[tuple[int, str, int], int]:
        counts: Counter[tuple[int, str, int]] = Counter()
        for index, device in enumerate(self._snapshot.get("gpus", ())):
            for event in device.get("nvmlEventSetWait_v2", ()):
                if event["eventType"] & pynvml.nvmlEventTypeXidCriticalError:
                    counts[(index, device["nvmlDeviceGetUUID"], event["eventData"])] += 1
        return dict(counts)


def _raise_if_error(value: Any) -> None:
    if isinstance(value, str) and value.startswith("NVML"):
        raise nvml_error(value)


# ---------------------------------------------------------------------------------------------
# Writing snapshots (tests, the demo, recordings from a real GPU)

H200_MEMORY_BYTES = 143771 * 2**20  # what nvidia-smi reports for an NVIDIA H200
NVLINK_LINKS = 18  # H100/H200 SXM
NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId outside MIG


def gpu_snapshot(uuid: str, name: str = "NVIDIA H200", memory_total: int = H200_MEMORY_BYTES) -> dict:
    """An idle, healthy GPU in the snapshot format; change its keys to advance it."""
    reserved = 580 * 2**20
    return {
        "nvmlDeviceGetUUID": uuid,
        "nvmlDeviceGetName": name,
        "nvmlDeviceGetUtilizationRates": {"gpu": 0, "memory": 0},
        "nvmlDeviceGetMemoryInfo": {
            "version": pynvml.nvmlMemory_v2,
            "total": memory_total,
            "reserved": reserved,
            "free": memory_total - reserved,
            "used": 0,
        },
        "nvmlDeviceGetPowerUsage": 75_000,
        "nvmlDeviceGetTotalEnergyConsumption": 0,
        "nvmlDeviceGetTemperatureV": {"NVML_TEMPERATURE_GPU": 30},
        "nvmlDeviceGetClockInfo": {"NVML_CLOCK_SM": 345, "NVML_CLOCK_MEM": 3201},
        "nvmlDeviceGetCurrentClocksEventReasons": pynvml.nvmlClocksEventReasonGpuIdle,
        "nvmlDeviceGetTotalEccErrors": {
            "NVML_MEMORY_ERROR_TYPE_CORRECTED": {"NVML_VOLATILE_ECC": 0},
            "NVML_MEMORY_ERROR_TYPE_UNCORRECTED": {"NVML_VOLATILE_ECC": 0},
        },
        "nvmlDeviceGetPcieThroughput": {"NVML_PCIE_UTIL_TX_BYTES": 0, "NVML_PCIE_UTIL_RX_BYTES": 0},
        "nvmlDeviceGetFieldValues": {
            "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX": [0] * NVLINK_LINKS,
            "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX": [0] * NVLINK_LINKS,
        },
        "nvmlDeviceGetComputeRunningProcesses": [],
        "nvmlDeviceGetMPSComputeRunningProcesses": [],
        "nvmlDeviceGetProcessUtilization": [],
        "nvmlEventSetWait_v2": [],
    }


def process_info(pid: int, used_bytes: int | None) -> dict:
    """One entry of nvmlDeviceGet(Compute|MPSCompute)RunningProcesses (nvmlProcessInfo_v3_t)."""
    return {"pid": pid, "usedGpuMemory": used_bytes, "gpuInstanceId": NO_INSTANCE, "computeInstanceId": NO_INSTANCE}


def xid_event(xid: int) -> dict:
    """One XID event as nvmlEventSetWait_v2 returns it (c_nvmlEventData_t, without the device pointer)."""
    return {
        "eventType": pynvml.nvmlEventTypeXidCriticalError,
        "eventData": xid,
        "gpuInstanceId": NO_INSTANCE,
        "computeInstanceId": NO_INSTANCE,
    }


def write_nvml_fixture(directory: Path | str, gpus: list[dict], **system: Any) -> Path:
    """Write (atomically replace) ``<directory>/nvml.json``; ``system`` adds top-level keys such as
    ``nvmlSystemGetDriverVersion="570.133.20"`` or ``nvmlInit="NVMLError_DriverNotLoaded"``."""
    path = Path(directory) / SNAPSHOT_FILE
    write_json_atomic(path, {**system, "gpus": gpus})
    return path


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON so a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the snapshot from a reader running as another user
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def record_nvml_fixture(source: NvmlSource, directory: Path | str) -> Path:
    """Snapshot every reading the collectors make from ``source`` (e.g. the real library) into the fixture format."""
    from stagetrace.collectors.mps import NVML_CALLS as MPS_CALLS  # the mps collector's readings

    calls = [("nvmlDeviceGetUUID",), ("nvmlDeviceGetName",), *(r.call for r in READINGS), *MPS_CALLS]
    source.open()
    try:
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
    finally:
        source.close()
    return write_nvml_fixture(directory, gpus)


# ---------------------------------------------------------------------------------------------
# The collector


@dataclass(frozen=True)
class GpuIdentity:
    gpu: int
    uuid: str = ""
    model: str = ""

    def labels(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "uuid": self.uuid, "model": self.model}


class CachedReads:
    """Reads through a source, remembering which (gpu, call) NVML does not support so it is not asked again.

    ``read`` returns None for "no answer" (unsupported, or a passing error this time); LOST-class errors
    propagate, since they say something about the GPU rather than the field.
    """

    def __init__(self, source: NvmlSource):
        self.source = source
        self._unsupported: set[tuple[int, tuple[str, ...]]] = set()
        self._logged: set[tuple[int, tuple[str, ...], str]] = set()

    def read(self, gpu: int, *call: str) -> Any:
        if (gpu, call) in self._unsupported:
            return None
        try:
            return self.source.read(gpu, *call)
        except NVML_ERRORS as exc:
            name = error_name(exc)
            if name in LOST:
                raise
            if name in UNSUPPORTED:
                self._unsupported.add((gpu, call))
                logger.debug("gpu %d: %s %s; not asked again until NVML is re-initialised", gpu, " ".join(call), name)
            elif (gpu, call, name) not in self._logged:
                self._logged.add((gpu, call, name))
                logger.warning("gpu %d: %s failed: %s", gpu, " ".join(call), name)
            return None

    def forget(self) -> None:
        """After NVML is re-initialised (the driver may have changed), ask everything once again."""
        self._unsupported.clear()
        self._logged.clear()


BACKOFF_FIRST_S = 5.0
BACKOFF_MAX_S = 300.0


@register
class GpuCollector(Collector):
    """NVIDIA GPUs through NVML: one set of ``gpu_*`` series per GPU, labelled gpu, uuid, model."""

    name = "gpu"

    def __init__(
        self, options: Options, *, source: NvmlSource | None = None, clock: Callable[[], float] = time.monotonic
    ):
        super().__init__(options)
        self.source = source if source is not None else nvml_source(options)
        self._reads = CachedReads(self.source)
        self._clock = clock
        self._open = False
        self._known: dict[str, GpuIdentity] = {}  # every GPU seen since start, by UUID
        self._identities: dict[int, GpuIdentity] = {}  # this NVML session's, by index
        self._lost: set[int] = set()  # this NVML session's lost GPUs: not asked again until re-init
        self._reinit_at: float | None = None
        self._backoff = BACKOFF_FIRST_S

    def collect(self, out: Samples) -> None:
        try:
            self._open_session()
            count = self.source.device_count() if self._open else 0
        except (SourceUnavailable, *NVML_ERRORS) as exc:
            if not self._known:  # never saw a GPU: the source is simply not here
                raise SourceUnavailable(unavailable_reason(exc)) from None
            self._session_lost(exc)
            count = 0
        reported = {self._collect_gpu(index, out).uuid for index in range(count)}
        for identity in self._known.values():
            if identity.uuid not in reported:
                out.add(UP, 0, **identity.labels())
        for (gpu, uuid, xid), n in sorted(self.source.xid_counts().items()):
            identity = self._known.get(uuid, GpuIdentity(gpu, uuid))
            out.add(XID_ERRORS, n, **identity.labels(), xid=xid)
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
            self.source.close()
        self._open = False
        self._identities.clear()
        self._lost.clear()
        self._reads.forget()

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
            for reading in READINGS:
                value = self._reads.read(index, *reading.call)
                if value is not None:
                    reading.emit(value, lambda spec, v, **extra: pending.append((spec, v, extra)))
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
        for spec, value, extra in pending:
            out.add(spec, value, **labels, **extra)
        return identity

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
