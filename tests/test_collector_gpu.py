"""The gpu collector, through recorded NVML snapshots and, for what this machine can show, the real library.

No GPU exists where these tests run, so the snapshots under tests/fixtures/node/nvml are written in
NVML's own shapes: what each pynvml call returns, NVML's error names for unsupported fields, the
events nvmlEventSetWait_v2 returns. The real pynvml source is exercised as far as a GPU-less machine
allows (nvmlInit fails with LibraryNotFound); scripts/gpu-check compares with nvidia-smi on a GPU.
"""

from __future__ import annotations

import ctypes
import json
import logging
import shutil
import time
from pathlib import Path

import pynvml
import pytest
from stagetrace.collectors.base import Node, Options, Samples, SourceUnavailable
from stagetrace.collectors.gpu import GpuCollector, record_nvml_fixture
from stagetrace.collectors.nvml import FixtureSource, PynvmlSource, gpu_snapshot, write_nvml_fixture, xid_event
from tests.samples import scrape as scrape_node
from tests.samples import series, value

FIXTURES = Path(__file__).parent / "fixtures" / "node"
NODE_NVML = FIXTURES / "nvml"
MiB = 2**20


def scrape(collector) -> dict[str, list[tuple[dict, float]]]:
    """One scrape through a Node (adds host, success and duration), as name → [(labels, value)]."""
    return scrape_node(Node([collector], host="n1"))


class CountingSource(FixtureSource):
    """The fixture source, counting what the collector asks of it."""

    def __init__(self, directory):
        super().__init__(directory)
        self.reads: dict[tuple, int] = {}
        self.opens = 0

    def open(self):
        self.opens += 1
        super().open()

    def read(self, gpu, function, *constants):
        key = (gpu, function, *constants)
        self.reads[key] = self.reads.get(key, 0) + 1
        return super().read(gpu, function, *constants)

    def reads_of(self, gpu: int) -> int:
        return sum(n for key, n in self.reads.items() if key[0] == gpu)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def node_copy(tmp_path) -> Path:
    """A writable copy of the 8-GPU snapshot, to advance within a test."""
    shutil.copy(NODE_NVML / "nvml.json", tmp_path / "nvml.json")
    return tmp_path


def edit(directory: Path, change) -> None:
    snapshot = json.loads((directory / "nvml.json").read_text())
    change(snapshot)
    gpus = snapshot.pop("gpus")
    write_nvml_fixture(directory, gpus, **snapshot)


def test_fixture_node_reports_every_gpu_in_base_units():
    result = scrape(GpuCollector(Options(nvml_fixture=NODE_NVML)))

    assert value(result, "stagetrace_collector_success", collector="gpu") == 1
    up = series(result, "gpu_up")
    assert [lbl["gpu"] for lbl, v in up if v == 1] == [str(i) for i in range(8)]
    assert {lbl["model"] for lbl, _ in up} == {"NVIDIA H200"} and all(lbl["host"] == "n1" for lbl, _ in up)
    gpu0 = {"gpu": 0, "uuid": "GPU-3f1c9a2e-7b4d-5e60-8a19-c2d4e6f80a10"}
    assert value(result, "gpu_memory_total_bytes", **gpu0) == 143771 * MiB
    assert value(result, "gpu_memory_used_bytes", **gpu0) == 612 * MiB + 80 * 1024 * MiB
    assert value(result, "gpu_utilization_ratio", **gpu0) == 0.91  # NVML percent
    assert value(result, "gpu_power_watts", **gpu0) == 612.345  # NVML mW
    assert value(result, "gpu_energy_joules_total", **gpu0) == 41234567.89  # NVML mJ
    assert value(result, "gpu_temperature_celsius", **gpu0) == 54
    assert value(result, "gpu_sm_clock_hertz", **gpu0) == 1980e6  # NVML MHz
    assert value(result, "gpu_memory_clock_hertz", **gpu0) == 3201e6
    assert value(result, "gpu_pcie_transmit_bytes_per_second", **gpu0) == 1843 * 1024  # NVML KB/s
    assert value(result, "gpu_nvlink_transmit_bytes_total", **gpu0, link=0) == 912_345_678_000 * 1024  # NVML KiB
    assert len(series(result, "gpu_nvlink_receive_bytes_total", **gpu0)) == 18
    assert value(result, "gpu_process_memory_used_bytes", **gpu0, pid=4242) == 612 * MiB
    assert series(result, "gpu_process_memory_used_bytes", gpu=4) == []  # usedGpuMemory not available


def test_ecc_and_xid_show_on_the_gpu_that_had_them():
    result = scrape(GpuCollector(Options(nvml_fixture=NODE_NVML)))

    assert value(result, "gpu_ecc_errors_total", gpu=5, type="uncorrected") == 1
    assert value(result, "gpu_ecc_errors_total", gpu=5, type="corrected") == 3
    assert sum(v for _, v in series(result, "gpu_ecc_errors_total", type="uncorrected")) == 1
    xids = series(result, "gpu_xid_errors_total")
    assert [(lbl["gpu"], lbl["xid"], lbl["uuid"], v) for lbl, v in xids] == [
        ("5", "48", "GPU-5c8d2f4a-1e7b-4c39-9a60-b2e4d7f1c853", 1)
    ]


def test_clock_event_reasons_are_decoded_from_the_bitmask(node_copy):
    result = scrape(GpuCollector(Options(nvml_fixture=NODE_NVML)))
    active = [(lbl["gpu"], lbl["reason"]) for lbl, v in series(result, "gpu_clock_event_active") if v == 1]
    assert active == [("6", "sw_thermal_slowdown")]
    assert len(series(result, "gpu_clock_event_active", gpu=0)) == 9  # every reason, 0 or 1

    edit(
        node_copy,
        lambda s: s["gpus"][1].update(
            nvmlDeviceGetCurrentClocksEventReasons=pynvml.nvmlClocksEventReasonSwPowerCap
            | pynvml.nvmlClocksEventReasonHwSlowdown
        ),
    )
    result = scrape(GpuCollector(Options(nvml_fixture=node_copy)))
    assert {lbl["reason"] for lbl, v in series(result, "gpu_clock_event_active", gpu=1) if v == 1} == {
        "sw_power_cap",
        "hw_slowdown",
    }


def test_unsupported_fields_are_dropped_once_and_not_asked_again(caplog):
    source = CountingSource(NODE_NVML)
    collector = GpuCollector(Options(), source=source)
    for _ in range(3):
        result = scrape(collector)

    # GPU 7 has no PCIe counters and GPU 3 no NVLink throughput, as recorded
    assert series(result, "gpu_pcie_transmit_bytes_per_second", gpu=7) == []
    assert series(result, "gpu_nvlink_transmit_bytes_total", gpu=3) == []
    assert value(result, "gpu_up", gpu=7) == 1 and value(result, "gpu_up", gpu=3) == 1
    assert source.reads[(7, "nvmlDeviceGetPcieThroughput", "NVML_PCIE_UTIL_TX_BYTES")] == 1
    assert source.reads[(3, "nvmlDeviceGetFieldValues", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX")] == 1
    assert source.reads[(6, "nvmlDeviceGetPcieThroughput", "NVML_PCIE_UTIL_TX_BYTES")] == 3
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_field_missing_from_the_snapshot_reads_as_not_supported(node_copy):
    edit(node_copy, lambda s: s["gpus"][2].pop("nvmlDeviceGetTotalEccErrors"))
    result = scrape(GpuCollector(Options(nvml_fixture=node_copy)))
    assert series(result, "gpu_ecc_errors_total", gpu=2) == []
    assert value(result, "gpu_up", gpu=2) == 1


def test_lost_gpu_reports_up_0_and_nvml_is_reinitialised_with_backoff(node_copy, caplog):
    clock, source = Clock(), CountingSource(node_copy)
    collector = GpuCollector(Options(), source=source, clock=clock)
    uuid3 = "GPU-1b9f6c2d-e8a4-4735-a0d1-5c7e9f2b3a68"
    assert value(scrape(collector), "gpu_up", gpu=3) == 1

    edit(node_copy, lambda s: s["gpus"][3].update(nvmlDeviceGetHandleByIndex="NVMLError_GpuIsLost"))
    clock.now = 1
    result = scrape(collector)
    assert value(result, "gpu_up", gpu=3, uuid=uuid3, model="NVIDIA H200") == 0
    assert series(result, "gpu_power_watts", gpu=3) == []
    assert sum(v for _, v in series(result, "gpu_up")) == 7
    assert value(result, "gpu_xid_errors_total", gpu=5, xid=48) == 1  # counts survive a broken collection
    assert value(result, "stagetrace_collector_success", collector="gpu") == 1
    lost_logs = [r for r in caplog.records if "NVMLError_GpuIsLost" in r.getMessage()]
    assert len(lost_logs) == 1 and "re-initialising NVML in 5s" in lost_logs[0].getMessage()

    reads_of_lost = source.reads_of(3)
    clock.now = 3  # within the back-off: the lost handle is left alone
    assert value(scrape(collector), "gpu_up", gpu=3) == 0
    assert source.opens == 1 and source.reads_of(3) == reads_of_lost

    clock.now = 6.5  # first re-init (after 5 s); still lost, so the next waits twice as long
    assert value(scrape(collector), "gpu_up", gpu=3) == 0
    assert source.opens == 2

    edit(node_copy, lambda s: s["gpus"][3].pop("nvmlDeviceGetHandleByIndex"))
    clock.now = 15  # 6.5 + 10 not reached yet
    assert value(scrape(collector), "gpu_up", gpu=3) == 0
    assert source.opens == 2
    clock.now = 17
    result = scrape(collector)
    assert source.opens == 3
    assert value(result, "gpu_up", gpu=3) == 1 and series(result, "gpu_power_watts", gpu=3)


def test_nvml_failing_after_a_good_start_reports_every_gpu_down_and_keeps_xids(node_copy):
    clock = Clock()
    collector = GpuCollector(Options(nvml_fixture=node_copy), clock=clock)
    scrape(collector)

    edit(node_copy, lambda s: s.update(nvmlDeviceGetCount="NVMLError_Unknown"))
    result = scrape(collector)
    assert [v for _, v in series(result, "gpu_up")] == [0] * 8
    assert value(result, "gpu_xid_errors_total", gpu=5, xid=48) == 1
    assert value(result, "stagetrace_collector_success", collector="gpu") == 1

    edit(node_copy, lambda s: s.pop("nvmlDeviceGetCount"))
    clock.now = 5
    assert sum(v for _, v in series(scrape(collector), "gpu_up")) == 8


def test_a_gpu_that_fell_off_the_bus_keeps_reporting_up_0(node_copy):
    collector = GpuCollector(Options(nvml_fixture=node_copy))
    scrape(collector)
    edit(node_copy, lambda s: s["gpus"].pop(7))  # NVML no longer enumerates it
    result = scrape(collector)
    assert value(result, "gpu_up", gpu=7, uuid="GPU-2d4f8a6c-b3e1-4907-8c5d-e9a7b1f3d026") == 0
    assert sum(v for _, v in series(result, "gpu_up")) == 7


def test_driver_not_loaded_is_source_unavailable_with_a_one_line_reason(tmp_path):
    write_nvml_fixture(tmp_path, [], nvmlInit="NVMLError_DriverNotLoaded")
    with pytest.raises(SourceUnavailable, match=r"^NVIDIA kernel driver not loaded .*load the nvidia module$"):
        GpuCollector(Options(nvml_fixture=tmp_path)).collect(Samples())


def _nvml_library_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


no_gpu_here = pytest.mark.skipif(
    _nvml_library_present(), reason="this machine has the NVML library (scripts/gpu-check covers it)"
)


@no_gpu_here
def test_real_pynvml_source_without_nvml_raises_source_unavailable():
    with pytest.raises(SourceUnavailable) as raised:
        PynvmlSource().open()
    assert str(raised.value) == "NVML library libnvidia-ml.so.1 not found: no NVIDIA driver on this host"


@no_gpu_here
def test_no_nvml_library_is_success_0_with_one_log_line(caplog):
    node = Node([GpuCollector(Options(nvml_fixture=None))], host="n1")
    for _ in range(3):
        families = {f.name: f for f in node.collect()}
        assert families["stagetrace_collector_success"].samples[0].value == 0
        assert set(families) == {"stagetrace_collector_success", "stagetrace_collector_duration_seconds"}
    logged = [r for r in caplog.records if r.name.startswith("stagetrace")]
    assert [r.getMessage() for r in logged] == [
        "collector gpu: NVML library libnvidia-ml.so.1 not found: no NVIDIA driver on this host"
    ]
    assert logged[0].exc_info is None


class StandInNvml:
    """Stands in for pynvml's event calls (no GPU here): two GPUs, events served from a queue.

    Handles and event data are pynvml's own ctypes types, so the watcher's handle matching is real.
    """

    def __init__(self, events: list[tuple[int, int]]):
        self.handles = [ctypes.pointer(pynvml.struct_c_nvmlDevice_t()) for _ in range(2)]
        self.events = list(events)  # (gpu index, xid)
        self.waits = 0

    def __getattr__(self, name):  # constants and exception classes come from pynvml itself
        return getattr(pynvml, name)

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.handles)

    def nvmlDeviceGetHandleByIndex(self, index):
        return self.handles[index]

    def nvmlDeviceGetUUID(self, handle):
        return f"GPU-{self.handles.index(handle)}"

    def nvmlEventSetCreate(self):
        return object()

    def nvmlDeviceRegisterEvents(self, handle, mask, event_set):
        assert mask == pynvml.nvmlEventTypeXidCriticalError

    def nvmlEventSetFree(self, event_set):
        pass

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        self.waits += 1
        if not self.events:
            time.sleep(0.01)
            raise pynvml.NVMLError_Timeout()
        gpu, xid = self.events.pop(0)
        data = pynvml.c_nvmlEventData_t()
        data.device, data.eventType, data.eventData = self.handles[gpu], pynvml.nvmlEventTypeXidCriticalError, xid
        return data


def _wait_for(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_xid_watcher_counts_events_on_its_own_thread_and_keeps_them_across_reinit():
    nvml = StandInNvml([(1, 79), (1, 79), (0, 48)])
    source = PynvmlSource(nvml)
    source.open()
    assert _wait_for(lambda: sum(source.xid_counts().values()) == 3)
    started = time.monotonic()
    source.close()
    assert time.monotonic() - started < 2  # close does not wait on the event set

    nvml.events.append((0, 48))
    source.open()
    assert _wait_for(lambda: source.xid_counts().get((0, "GPU-0", 48)) == 2)
    source.close()
    assert source.xid_counts() == {(1, "GPU-1", 79): 2, (0, "GPU-0", 48): 2}


def test_record_writes_what_the_source_answers_in_the_fixture_format(tmp_path):
    one = gpu_snapshot("GPU-abc")
    one["nvmlDeviceGetPcieThroughput"] = "NVMLError_NotSupported"
    one["nvmlEventSetWait_v2"] = [xid_event(79)]
    write_nvml_fixture(tmp_path / "from", [one])

    record_nvml_fixture(FixtureSource(tmp_path / "from"), tmp_path / "to")
    recorded = json.loads((tmp_path / "to" / "nvml.json").read_text())["gpus"][0]
    assert recorded["nvmlDeviceGetPcieThroughput"] == {
        "NVML_PCIE_UTIL_TX_BYTES": "NVMLError_NotSupported",
        "NVML_PCIE_UTIL_RX_BYTES": "NVMLError_NotSupported",
    }
    assert recorded["nvmlEventSetWait_v2"] == []  # events are counted, not readable afterwards
    again = scrape(GpuCollector(Options(nvml_fixture=tmp_path / "to")))
    first = scrape(GpuCollector(Options(nvml_fixture=tmp_path / "from")))
    first.pop("gpu_xid_errors_total")
    for name in ("stagetrace_collector_duration_seconds",):
        again.pop(name), first.pop(name)
    assert again == first


def test_gpu_info_carries_the_driver_cuda_and_the_modes_that_change_numerics(node_copy):
    """gpu_info: the driver's versions asked once a session, each GPU's current ECC and MIG modes; a driver that
    does not say leaves the label empty rather than the series out."""

    def modes(snapshot):
        snapshot["gpus"][1]["nvmlDeviceGetEccMode"] = [0, 1]  # off now, on after the next reset
        snapshot["gpus"][2]["nvmlDeviceGetMigMode"] = [1, 1]
        snapshot["gpus"][3].pop("nvmlDeviceGetEccMode")
        snapshot.pop("nvmlSystemGetCudaDriverVersion")

    edit(node_copy, modes)
    source = CountingSource(node_copy)
    collector = GpuCollector(Options(), source=source)
    info = {labels["gpu"]: labels for labels, _ in scrape(collector)["gpu_info"]}
    assert len(info) == 8 and {i["driver_version"] for i in info.values()} == {"570.133.20"}
    assert {i["cuda_version"] for i in info.values()} == {""}
    assert (info["0"]["ecc_mode"], info["0"]["mig_mode"]) == ("enabled", "disabled")
    assert (info["1"]["ecc_mode"], info["2"]["mig_mode"], info["3"]["ecc_mode"]) == ("disabled", "enabled", "")
    assert scrape(GpuCollector(Options(nvml_fixture=NODE_NVML)))["gpu_info"][0][0]["cuda_version"] == "12.8"


def test_a_gpu_lost_while_its_inventory_is_read_is_that_gpu_lost(node_copy):
    def lose(snapshot):
        snapshot["gpus"][5]["nvmlDeviceGetEccMode"] = "NVMLError_GpuIsLost"

    edit(node_copy, lose)
    scraped = scrape(GpuCollector(Options(nvml_fixture=node_copy)))
    up = {labels["gpu"]: value for labels, value in scraped["gpu_up"]}
    assert up["5"] == 0 and all(up[str(gpu)] == 1 for gpu in range(8) if gpu != 5)
    assert {labels["gpu"] for labels, _ in scraped["gpu_info"]} == {str(g) for g in range(8) if g != 5}
