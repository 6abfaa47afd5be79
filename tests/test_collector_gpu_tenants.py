"""Each GPU's processes and the pods they belong to, in the gpu collector.

tests/fixtures/node/nvml/h200-mps-two-pods is a real H200 shared by MPS (README beside it): the MPS server and two
clients, whose memory NVML lists in both process calls and whose utilization it samples for the server alone. The
fixture /proc tree (tests/fixtures/node/proc) holds each process's cgroup in the kubelet's layouts (systemd and
cgroupfs drivers, cgroup v1 and v2) and the host's /var/log (tests/fixtures/node/log) the kubelet's pod and
container log names; tests/fixtures/kubelet/h200-mps-two-pods the PodResources answers of that node.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from stagetrace.collectors import build_node
from stagetrace.collectors.base import Node, Options
from stagetrace.collectors.gpu import GpuCollector
from stagetrace.collectors.gpu_tenants import cgroup_ids
from stagetrace.collectors.nvml import gpu_snapshot, process_info, write_nvml_fixture
from tests.samples import scrape, series, value

FIXTURES = Path(__file__).parent / "fixtures"
NODE = FIXTURES / "node"
MPS = NODE / "nvml" / "h200-mps-two-pods"
MATMUL = NODE / "nvml" / "h200-gpm"
PROC, LOG = NODE / "proc", NODE / "log"
UUID = "GPU-4c4fe893-1a00-9730-b11e-e385d2eac15f"
MPS_DAEMON_POD = "nvidia-device-plugin-mps-control-daemon-4hx2n"  # where NVIDIA's device plugin runs the MPS server


def recorded(directory: Path) -> dict:
    return json.loads((directory / "nvml.json").read_text())["gpus"][0]


def gpu_node(nvml: Path, procfs: Path = PROC, log: Path = LOG) -> Node:
    return Node([GpuCollector(Options(nvml_fixture=nvml, procfs=procfs, kubelet_log_dir=log))], host="n1")


def tenants(result, name="gpu_tenant_memory_used_bytes") -> dict[tuple[str, str], float]:
    return {(labels["namespace"], labels["pod"]): v for labels, v in series(result, name, gpu=0)}


def test_mps_tenants_memory_adds_up_to_the_devices_used_memory_once():
    gpu = recorded(MPS)
    result = scrape(gpu_node(MPS))

    memory = tenants(result)
    clients = {p["pid"]: p["usedGpuMemory"] for p in gpu["nvmlDeviceGetMPSComputeRunningProcesses"]}
    server = {
        p["pid"]: p["usedGpuMemory"] for p in gpu["nvmlDeviceGetComputeRunningProcesses"] if p["pid"] not in clients
    }
    assert memory == {
        ("voice", "tts-0"): clients[1031],
        ("batch", "worker-0"): clients[1032],
        ("kube-system", MPS_DAEMON_POD): server[1065],
    }
    used = gpu["nvmlDeviceGetMemoryInfo"]["used"]
    unattributed = value(result, "gpu_memory_unattributed_bytes", gpu=0)
    assert sum(memory.values()) + unattributed == used == value(result, "gpu_memory_used_bytes", gpu=0)
    assert 0 < unattributed < 16 * 2**20  # the driver's own contexts, not a process counted twice


def test_mps_clients_get_no_sm_share_and_say_why():
    result = scrape(gpu_node(MPS))
    assert tenants(result, "gpu_tenant_mps_clients") == {
        ("voice", "tts-0"): 1,
        ("batch", "worker-0"): 1,
        ("kube-system", MPS_DAEMON_POD): 0,
    }
    # NVML samples the server alone: its pod gets the SM share, the clients' pods none (not a 0 that reads as idle)
    assert tenants(result, "gpu_tenant_sm_utilization_ratio") == {("kube-system", MPS_DAEMON_POD): 0.98}
    roles = {labels["pid"]: (labels["role"], labels["container"]) for labels, _ in series(result, "gpu_process_info")}
    assert roles == {
        "1065": ("mps_server", "mps-control-daemon"),
        "1031": ("mps_client", "tts"),
        "1032": ("mps_client", "worker"),
    }
    assert [labels["pid"] for labels, _ in series(result, "gpu_process_sm_utilization_ratio")] == ["1065"]


def test_tenants_join_the_kubelets_allocations_by_gpu_and_pod(kubelet):
    options = Options(
        host="n1",
        nvml_fixture=MPS,
        procfs=PROC,
        kubelet_log_dir=LOG,
        kubelet_socket=kubelet(FIXTURES / "kubelet" / "h200-mps-two-pods"),
    )
    result = scrape(build_node("gpu,kubernetes", options))
    allocated = {(lbl["uuid"], lbl["namespace"], lbl["pod"]) for lbl, _ in series(result, "k8s_gpu_allocation_info")}
    using = {(lbl["uuid"], lbl["namespace"], lbl["pod"]) for lbl, v in series(result, "gpu_tenant_mps_clients") if v}
    assert using == allocated == {(UUID, "voice", "tts-0"), (UUID, "batch", "worker-0")}


def test_clients_listed_only_by_the_mps_call_are_counted_once():
    """An older shape: the compute list holds the server alone, the MPS list the clients (one-gpu-two-clients)."""
    nvml = NODE / "nvml" / "one-gpu-two-clients"
    gpu = recorded(nvml)
    result = scrape(gpu_node(nvml))
    held = sum(v for _, v in series(result, "gpu_tenant_memory_used_bytes"))
    listed = {
        p["pid"]: p["usedGpuMemory"]
        for key in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses")
        for p in gpu[key]
    }
    assert held == sum(listed.values()) == gpu["nvmlDeviceGetMemoryInfo"]["used"]
    assert value(result, "gpu_memory_unattributed_bytes", gpu=0) == 0


def test_a_pid_in_no_pod_is_its_own_tenant_without_a_pod():
    """The matmul recording's process ran from a shell on the host (user.slice)."""
    gpu = recorded(MATMUL)
    result = scrape(gpu_node(MATMUL))
    assert tenants(result) == {("", ""): gpu["nvmlDeviceGetComputeRunningProcesses"][0]["usedGpuMemory"]}
    ((labels, _),) = series(result, "gpu_process_info", pid=945)
    assert (labels["namespace"], labels["pod"], labels["container"], labels["role"]) == ("", "", "", "compute")
    assert tenants(result, "gpu_tenant_sm_utilization_ratio") == {("", ""): 0.99}


@pytest.fixture
def node_dirs(tmp_path) -> tuple[Path, Path, Path]:
    """Writable copies of the MPS snapshot, the /proc tree and the log tree."""
    nvml = tmp_path / "nvml"
    nvml.mkdir()
    shutil.copy(MPS / "nvml.json", nvml / "nvml.json")
    return (
        nvml,
        Path(shutil.copytree(PROC, tmp_path / "proc")),
        Path(shutil.copytree(LOG, tmp_path / "log", symlinks=True)),
    )


def edit(directory: Path, change) -> None:
    snapshot = json.loads((directory / "nvml.json").read_text())
    change(snapshot["gpus"][0])
    gpus = snapshot.pop("gpus")
    write_nvml_fixture(directory, gpus, **snapshot)


def test_a_process_that_exits_between_nvmls_answer_and_its_proc_read_keeps_its_pod(node_dirs):
    nvml, proc, log = node_dirs
    node = gpu_node(nvml, proc, log)
    before = tenants(scrape(node))

    shutil.rmtree(proc / "1031")  # gone from /proc, still in NVML's answer of this scrape
    result = scrape(node)
    assert tenants(result) == before
    assert value(result, "gpu_process_info", pid=1031, pod="tts-0") == 1

    edit(
        nvml,
        lambda gpu: [
            gpu[k].remove(next(p for p in gpu[k] if p["pid"] == 1031))
            for k in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses")
        ],
    )
    result = scrape(node)  # NVML no longer lists it: its series go, nothing lingers
    assert ("voice", "tts-0") not in tenants(result) and not series(result, "gpu_process_info", pid=1031)


def test_a_process_gone_before_it_was_ever_read_still_counts_its_memory(node_dirs):
    nvml, proc, log = node_dirs

    def appear(gpu):  # a process NVML lists (and counts in used memory) that exited before /proc was read
        gpu["nvmlDeviceGetComputeRunningProcesses"].append(process_info(4321, 512 * 2**20))
        gpu["nvmlDeviceGetMemoryInfo"]["used"] += 512 * 2**20

    edit(nvml, appear)
    result = scrape(gpu_node(nvml, proc, log))
    memory = tenants(result)
    assert memory[("", "")] == 512 * 2**20  # no /proc/4321: owner unknown, memory still counted, once
    used = value(result, "gpu_memory_used_bytes", gpu=0)
    assert sum(memory.values()) + value(result, "gpu_memory_unattributed_bytes", gpu=0) == used


def test_time_slicing_gives_each_pod_its_processes_sm_share(tmp_path):
    """Without MPS NVML samples each process: two pods' processes on one GPU, one of which exits between the
    process list and the utilization call (its work in the window still counts for its pod)."""
    snapshot = gpu_snapshot("GPU-shared")
    snapshot["nvmlDeviceGetMemoryInfo"]["used"] = 30 * 2**30
    snapshot["nvmlDeviceGetComputeRunningProcesses"] = [process_info(1031, 20 * 2**30), process_info(1032, 10 * 2**30)]
    snapshot["nvmlDeviceGetProcessUtilization"] = [
        {"pid": 1031, "timeStamp": 1, "smUtil": 60, "memUtil": 20, "encUtil": 0, "decUtil": 0},
        {"pid": 1031, "timeStamp": 2, "smUtil": 40, "memUtil": 10, "encUtil": 0, "decUtil": 0},
        {"pid": 1032, "timeStamp": 3, "smUtil": 30, "memUtil": 5, "encUtil": 0, "decUtil": 0},
    ]
    write_nvml_fixture(tmp_path, [snapshot])
    node = gpu_node(tmp_path)
    result = scrape(node)
    assert tenants(result, "gpu_tenant_sm_utilization_ratio") == pytest.approx(
        {("voice", "tts-0"): 0.5, ("batch", "worker-0"): 0.3}
    )
    assert tenants(result, "gpu_tenant_memory_copy_utilization_ratio") == pytest.approx(
        {("voice", "tts-0"): 0.15, ("batch", "worker-0"): 0.05}
    )
    assert value(result, "gpu_process_sm_utilization_ratio", pid=1031) == pytest.approx(0.5)

    snapshot["nvmlDeviceGetComputeRunningProcesses"].pop()  # 1032 exited after its last sample
    snapshot["nvmlDeviceGetMemoryInfo"]["used"] = 20 * 2**30
    write_nvml_fixture(tmp_path, [snapshot])
    result = scrape(node)
    assert tenants(result, "gpu_tenant_sm_utilization_ratio")[("batch", "worker-0")] == pytest.approx(0.3)
    assert tenants(result)[("batch", "worker-0")] == 0 and not series(result, "gpu_process_info", pid=1032)


def test_a_process_idle_since_the_last_call_reads_0_not_absent(tmp_path):
    snapshot = gpu_snapshot("GPU-idle")
    snapshot["nvmlDeviceGetComputeRunningProcesses"] = [process_info(1031, 2**30)]
    write_nvml_fixture(tmp_path, [snapshot])  # NVML samples only processes that used the GPU
    result = scrape(gpu_node(tmp_path))
    assert tenants(result, "gpu_tenant_sm_utilization_ratio") == {("voice", "tts-0"): 0}


def test_without_the_hosts_pid_namespace_all_used_memory_is_unattributed(tmp_path):
    """NVML lists only the caller's namespace's processes: none, for an agent without hostPID."""
    gpu = recorded(MPS)
    for key in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses"):
        gpu[key] = []
    gpu["nvmlDeviceGetProcessUtilization"] = "NVMLError_NotFound"
    write_nvml_fixture(tmp_path, [gpu])
    result = scrape(gpu_node(tmp_path))
    assert not series(result, "gpu_tenant_memory_used_bytes")
    assert value(result, "gpu_memory_unattributed_bytes", gpu=0) == gpu["nvmlDeviceGetMemoryInfo"]["used"]
    assert not series(result, "gpu_nvml_errors_total", function="nvmlDeviceGetProcessUtilization")  # not asked


def test_process_call_errors_are_counted_and_the_rest_still_reported(node_dirs):
    nvml, proc, log = node_dirs
    edit(
        nvml,
        lambda gpu: gpu.update(
            nvmlDeviceGetProcessUtilization="NVMLError_Timeout",
            nvmlDeviceGetMPSComputeRunningProcesses="NVMLError_NotSupported",
        ),
    )
    node = gpu_node(nvml, proc, log)
    for _ in range(2):
        result = scrape(node)
    assert value(result, "stagetrace_collector_success", collector="gpu") == 1
    errors = {(lbl["function"], lbl["error"]): v for lbl, v in series(result, "gpu_nvml_errors_total", gpu=0)}
    assert errors[("nvmlDeviceGetProcessUtilization", "NVMLError_Timeout")] == 2  # asked again: it may pass
    assert errors[("nvmlDeviceGetMPSComputeRunningProcesses", "NVMLError_NotSupported")] == 1  # not asked again
    assert not series(result, "gpu_tenant_sm_utilization_ratio")
    # the compute list still holds every process, so the memory still adds up
    used = value(result, "gpu_memory_used_bytes", gpu=0)
    assert sum(tenants(result).values()) + value(result, "gpu_memory_unattributed_bytes", gpu=0) == used


def test_a_pod_without_its_container_log_link_is_named_by_its_pod_directory(node_dirs):
    nvml, proc, log = node_dirs
    for link in (log / "containers").glob("tts-0_*"):
        link.unlink()
    shutil.rmtree(next((log / "pods").glob("batch_worker-0_*")))
    for link in (log / "containers").glob("worker-0_*"):
        link.unlink()
    result = scrape(gpu_node(nvml, proc, log))
    ((tts, _),) = series(result, "gpu_process_info", pid=1031)
    assert (tts["namespace"], tts["pod"], tts["container"]) == ("voice", "tts-0", "")
    ((worker, _),) = series(result, "gpu_process_info", pid=1032)  # neither names it: its UID keeps it apart
    assert (worker["namespace"], worker["pod"]) == ("", "uid:9b3e6a14-2f75-4c08-b1d9-7e5a3c2f6d92")


@pytest.mark.parametrize(
    ("cgroup", "ids"),
    [
        (
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod5f0c2d7e_8a41_4b69_9e13_2c7d4a6b8f01.slice/"
            "cri-containerd-" + "a1" * 32 + ".scope\n",
            ("5f0c2d7e-8a41-4b69-9e13-2c7d4a6b8f01", "a1" * 32),
        ),
        (
            "12:memory:/kubepods/besteffort/pod9b3e6a14-2f75-4c08-b1d9-7e5a3c2f6d92/" + "b2" * 32 + "\n0::/\n",
            ("9b3e6a14-2f75-4c08-b1d9-7e5a3c2f6d92", "b2" * 32),
        ),
        (
            "0::/kubepods/pod9b3e6a14-2f75-4c08-b1d9-7e5a3c2f6d92/crio-" + "c3" * 32 + ".scope\n",
            ("9b3e6a14-2f75-4c08-b1d9-7e5a3c2f6d92", "c3" * 32),
        ),
        # read from inside a container with its own cgroup namespace: paths relative to the agent's cgroup
        (
            "0::/../../kubepods-besteffort-pod9b3e6a14_2f75_4c08_b1d9_7e5a3c2f6d92.slice/docker-"
            + "d4" * 32
            + ".scope\n",
            ("9b3e6a14-2f75-4c08-b1d9-7e5a3c2f6d92", "d4" * 32),
        ),
        (
            "0::/kubepods.slice/kubepods-pod9b3e6a14_2f75_4c08_b1d9_7e5a3c2f6d92.slice\n",
            ("9b3e6a14-2f75-4c08-b1d9-7e5a3c2f6d92", ""),
        ),  # the pod's own cgroup (a process outside its containers)
        ("0::/system.slice/containerd.service\n", None),
        ("0::/\n", None),
    ],
)
def test_cgroup_ids_read_the_kubelets_layouts(cgroup, ids):
    assert cgroup_ids(cgroup) == ids
