"""NVML as the gpu and mps collectors (and the process's configuration, ``stagetrace.configuration``) read it: the
real library, or recorded snapshots in NVML's own shapes. The binding is in the core, not among the collectors, so
that a core module reading the driver need not import a collector.

:class:`NvmlSource` is the seam. :class:`PynvmlSource` calls nvidia-ml-py (module ``pynvml``) and counts
XID events on its own thread; :class:`FixtureSource` answers from a snapshot, for tests and the demo on
machines without a GPU (node_exporter's wifi/qdisc ``*.fixtures`` pattern). Both answer
``read(gpu, function, *constants)`` with what the pynvml call returns, as plain data, and raise pynvml's
own exceptions; the collectors decide what an error means (``UNSUPPORTED``, ``LOST``).

Fixture format: ``<fixture directory>/nvml.json`` (``--nvml-fixture``, ``STAGETRACE_NVML_FIXTURE``) (see :func:`write_nvml_fixture`)::

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
        "nvmlEventSetWait_v2": [{"eventType": 8, "eventData": 48, "gpuInstanceId": …, "computeInstanceId": …}],
        "nvmlGpmQueryDeviceSupport": {"version": 1, "isSupportedDevice": 1},
        "nvmlGpmMetricsGet": [[{"metricId": 2, "nvmlReturn": 0, "value": 95.9}, …], …],   # one per interval
        "nvmlGpmMigSampleGet": {"1": [[… the same, for GPU instance 1 …]]}}]}

Each key is a pynvml function; its value is what the call returns, structs as objects with the C field
names. A call that takes constants nests one object per argument, keyed by the pynvml constant's name.
``"NVMLError_<Name>"`` in place of any value raises that exception (a missing key reads as
``NVMLError_NotSupported``); ``"nvmlDeviceGetHandleByIndex": "NVMLError_GpuIsLost"`` makes every call
for that GPU fail so; top-level ``"nvmlInit"`` / ``"nvmlDeviceGetCount"`` may hold an error too.
``nvmlEventSetWait_v2`` lists every event recorded since start (eventType 8 =
``nvmlEventTypeXidCriticalError``, eventData = the XID); ``null`` in a per-link list is a link NVML
answered with an error.

GPM (GPU Performance Monitoring, Hopper and newer) samples are opaque handles; what a recording can hold is what
``nvmlGpmMetricsGet`` answered between two consecutive samples: ``nvmlGpmMetricsGet`` lists those answers, one per
interval, each the ``metrics`` array of ``c_nvmlGpmMetricsGet_t`` (``metricId``, ``nvmlReturn``: 0 or NVML's error
code, ``value``: percent or MiB/s; ``metricInfo`` is left out, nothing reads it). The n-th sample taken of a GPU
closes the (n-1)-th interval, round the list again at its end, so a replay runs for as long as it is scraped; a
metric the recording does not hold reads as ``NVML_ERROR_NOT_SUPPORTED``. ``nvmlGpmMigSampleGet`` holds the same per
MIG GPU instance ID. An error name as ``nvmlGpmSampleGet`` makes taking a sample fail, as ``nvmlGpmMetricsGet``
computing the metrics. The file is read again at each scrape, so a writer may advance it; use
:func:`write_nvml_fixture` (atomic replace) and :func:`gpu_snapshot` for an idle GPU to start from.
:func:`stagetrace.collectors.gpu.record_nvml_fixture` writes the same format from any source, the real
library included.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import pynvml

from stagetrace.errors import SourceUnavailable

logger = logging.getLogger("stagetrace.collectors.gpu")

SNAPSHOT_FILE = "nvml.json"

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

    def system(self, function: str) -> Any:
        """What ``pynvml.<function>()`` returns (``nvmlSystemGetDriverVersion``...); raises pynvml errors."""

    def xid_counts(self) -> Mapping[tuple[int, str, int], int]:
        """XID critical-error events seen since the source was created, by (gpu index, uuid, xid)."""

    def gpu_instances(self, gpu: int) -> list[int]:
        """The MIG GPU instance IDs of a GPU whose MIG mode is on; raises pynvml errors."""

    def gpm_sample(self, gpu: int, instance: int | None = None) -> Any:
        """A new GPM sample of the GPU (``nvmlGpmSampleGet``) or of one of its MIG GPU instances
        (``nvmlGpmMigSampleGet``): an opaque handle for :meth:`gpm_metrics`, freed with :meth:`gpm_free`."""

    def gpm_metrics(self, older: Any, newer: Any, metric_ids: tuple[int, ...]) -> dict[int, float | str]:
        """``nvmlGpmMetricsGet`` between two samples of one GPU: each metric's value (NVML's percent or MiB/s), or
        the name of the error NVML answered for that metric (``NVMLError_NotSupported``); raises pynvml errors."""

    def gpm_free(self, sample: Any) -> None: ...


def open_source(fixture: Path | None, watch_xids: bool = True) -> NvmlSource:
    """The recorded snapshot in ``fixture`` when it is set, else the real library (not opened yet)."""
    return FixtureSource(fixture) if fixture else PynvmlSource(watch_xids=watch_xids)


# the driver's versions, by the label gpu_info gives each: what NVML's system calls answer
SYSTEM_CALLS = {"driver_version": "nvmlSystemGetDriverVersion", "cuda_version": "nvmlSystemGetCudaDriverVersion"}


def driver_versions(source: NvmlSource) -> dict[str, str]:
    """The driver's version and the CUDA version it supports (``570.133.20``, ``12.8``), those NVML answers."""
    out = {}
    for label, function in SYSTEM_CALLS.items():
        try:
            value = source.system(function)
        except NVML_ERRORS as exc:
            logger.debug("%s: %s", function, error_name(exc))
            continue
        # the CUDA version comes as 1000 * major + 10 * minor
        out[label] = f"{value // 1000}.{value % 1000 // 10}" if isinstance(value, int) else str(value)
    return out


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

    def system(self, function: str) -> Any:
        call = getattr(self.nvml, function, None)
        if call is None:
            raise self.nvml.NVMLError_FunctionNotFound()
        return plain(call())

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

    def gpu_instances(self, gpu: int) -> list[int]:
        handle = self._handle(gpu)
        ids = set()
        for index in range(self.nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:  # one handle per compute instance; several may share a GPU instance
                mig = self.nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
            except self.nvml.NVMLError_NotFound:
                continue
            ids.add(self.nvml.nvmlDeviceGetGpuInstanceId(mig))
        return sorted(ids)

    def gpm_sample(self, gpu: int, instance: int | None = None) -> Any:
        handle = self._handle(gpu)
        sample = self.nvml.nvmlGpmSampleAlloc()
        try:
            if instance is None:
                self.nvml.nvmlGpmSampleGet(handle, sample)
            else:
                self.nvml.nvmlGpmMigSampleGet(handle, instance, sample)
        except NVML_ERRORS:
            self.nvml.nvmlGpmSampleFree(sample)
            raise
        return sample

    def gpm_metrics(self, older: Any, newer: Any, metric_ids: tuple[int, ...]) -> dict[int, float | str]:
        request = self.nvml.c_nvmlGpmMetricsGet_t()
        request.version = self.nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(metric_ids)
        request.sample1, request.sample2 = older, newer
        for slot, metric_id in enumerate(metric_ids):
            request.metrics[slot].metricId = metric_id
        self.nvml.nvmlGpmMetricsGet(request)
        return gpm_answers(plain(request.metrics[slot]) for slot in range(len(metric_ids)))

    def gpm_free(self, sample: Any) -> None:
        self.nvml.nvmlGpmSampleFree(sample)

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
        self._gpm_taken: Counter[tuple[int, int | None]] = Counter()  # samples taken, by (gpu, GPU instance)

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

    def system(self, function: str) -> Any:
        value = self._snapshot.get(function, "NVMLError_NotSupported")
        _raise_if_error(value)
        return value

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

    def gpu_instances(self, gpu: int) -> list[int]:
        return sorted(int(instance) for instance in self.read(gpu, "nvmlGpmMigSampleGet"))

    def gpm_sample(self, gpu: int, instance: int | None = None) -> RecordedGpmSample:
        device = self._snapshot["gpus"][gpu]
        _raise_if_error(device.get("nvmlDeviceGetHandleByIndex"))
        if instance is None:
            _raise_if_error(device.get("nvmlGpmSampleGet"))  # an error here: sampling fails
            recorded = device.get("nvmlGpmMetricsGet", "NVMLError_NotSupported")  # an error here: the metrics do
        else:
            recorded = self.read(gpu, "nvmlGpmMigSampleGet").get(str(instance), "NVMLError_NotFound")
        self._gpm_taken[(gpu, instance)] += 1
        return RecordedGpmSample(recorded, self._gpm_taken[(gpu, instance)])

    def gpm_metrics(self, older: Any, newer: Any, metric_ids: tuple[int, ...]) -> dict[int, float | str]:
        _raise_if_error(newer.intervals)
        if not newer.intervals:
            raise pynvml.NVMLError_NotSupported()
        answered = gpm_answers(newer.intervals[(newer.number - 2) % len(newer.intervals)])
        return {metric_id: answered.get(metric_id, "NVMLError_NotSupported") for metric_id in metric_ids}

    def gpm_free(self, sample: Any) -> None:
        pass


class RecordedGpmSample:
    """A GPM sample replayed from a recording: the recorded intervals and which sample of the GPU this is."""

    def __init__(self, intervals: list | str, number: int):
        self.intervals = intervals
        self.number = number


def gpm_answers(metrics) -> dict[int, float | str]:
    """``c_nvmlGpmMetric_t`` entries (as plain data) as metric ID → value, or the error NVML answered for it."""
    answers: dict[int, float | str] = {}
    for metric in metrics:
        code = metric["nvmlReturn"]
        answers[metric["metricId"]] = metric["value"] if code == pynvml.NVML_SUCCESS else nvml_error_name(code)
    return answers


def nvml_error_name(code: int) -> str:
    """The pynvml exception name of an NVML return code (3 → ``NVMLError_NotSupported``)."""
    try:
        return pynvml.nvmlExceptionClass(code).__name__
    except ValueError:
        return "NVMLError_Unknown"


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


class CachedReads:
    """Reads through a source, remembering which (gpu, call) NVML does not support so it is not asked again.

    ``read`` returns None for "no answer" (unsupported, or a passing error this time); LOST-class errors
    propagate, since they say something about the GPU rather than the field.
    """

    def __init__(self, source: NvmlSource):
        self.source = source
        self._unsupported: set[tuple[int, tuple[str, ...]]] = set()
        self._logged: set[tuple[int, tuple[str, ...], str]] = set()
        # every error NVML answered, by (gpu, function, error name): kept across re-initialisations, as counts are
        self.errors: Counter[tuple[int, str, str]] = Counter()

    def read(self, gpu: int, *call: str) -> Any:
        if (gpu, call) in self._unsupported:
            return None
        try:
            return self.source.read(gpu, *call)
        except NVML_ERRORS as exc:
            return self.failed(gpu, call, exc)

    def failed(self, gpu: int, call: tuple[str, ...], exc: BaseException) -> None:
        """Count an NVML error of ``call`` (function and constants) and decide what it means: LOST-class errors
        propagate; an unsupported call is not asked again; any other is logged once and read as no answer."""
        name = error_name(exc)
        self.errors[(gpu, call[0], name)] += 1
        if name in LOST:
            raise exc
        if name in UNSUPPORTED:
            self._unsupported.add((gpu, call))
            logger.debug("gpu %d: %s %s; not asked again until NVML is re-initialised", gpu, " ".join(call), name)
        elif (gpu, call, name) not in self._logged:
            self._logged.add((gpu, call, name))
            logger.warning("gpu %d: %s failed: %s", gpu, " ".join(call), name)
        return None

    def unsupported(self, gpu: int, *call: str) -> bool:
        """Whether NVML said it does not support ``call`` on this GPU (this session)."""
        return (gpu, call) in self._unsupported

    def forget(self) -> None:
        """After NVML is re-initialised (the driver may have changed), ask everything once again."""
        self._unsupported.clear()
        self._logged.clear()


__all__ = [
    "H200_MEMORY_BYTES",
    "LOST",
    "NO_INSTANCE",
    "NVLINK_LINKS",
    "NVML_ERRORS",
    "SNAPSHOT_FILE",
    "SYSTEM_CALLS",
    "UNSUPPORTED",
    "XID_WAIT_MS",
    "CachedReads",
    "FixtureSource",
    "NvmlSource",
    "PynvmlSource",
    "RecordedGpmSample",
    "XidWatcher",
    "driver_versions",
    "error_name",
    "gpm_answers",
    "gpu_snapshot",
    "nvml_error",
    "nvml_error_name",
    "open_source",
    "plain",
    "process_info",
    "unavailable_reason",
    "write_json_atomic",
    "write_nvml_fixture",
    "xid_event",
]
