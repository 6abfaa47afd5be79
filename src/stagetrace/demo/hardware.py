"""A simulated node's hardware, exposed the way real hardware is, and read by the real collectors.

The NIC is a sysfs tree in the ``/sys/class/infiniband`` layout (mlx5 port and hw counters, the
data counters in 4-byte words as the kernel keeps them); the GPUs are NVML snapshots in the gpu
collector's recorded-fixture format; on the node that shares a GPU, a kubelet serves the node's
PodResources over gRPC on a unix socket beside them (``<host>/kubelet/kubelet.sock``, recorded answers
in the same folder), which the kubernetes collector reads as it reads a real kubelet. Every host has its own tree, including
the remote host of a two-host TP group, and its samples carry its own ``host.name``. The workload
and the faults advance the counters; sampling writes them out and scrapes them with the ``rdma``,
``gpu`` (and there ``mps`` and ``kubernetes``) collectors into metric rows.

Each node's pod ``rag-demo/<host>-engine`` holds its GPUs. A node with ``shared_gpu`` runs NVIDIA's
device plugin with MPS sharing (2 replicas per GPU, device IDs ``<uuid>::0`` and ``<uuid>::1``) and
an MPS daemon: the engine holds replica 0 of GPUs 0-2, and a TTS service and a worker, two pods, hold
GPU 3's two replicas and run on it as its two MPS clients. The scheduler then counts 8 GPUs where
there are 4, and GPU 3 as used twice: the state the kubernetes collector names (no span runs on GPU 3).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from pathlib import Path

from stagetrace.collectors import build_node
from stagetrace.collectors.base import Options
from stagetrace.collectors.mps import write_mps_fixture
from stagetrace.nvml import H200_MEMORY_BYTES, gpu_snapshot, process_info, write_nvml_fixture, xid_event
from stagetrace.collectors.podresources import RecordedKubelet, write_answers
from stagetrace.demo.faults import OTHER_GPU_MODEL, REFERENCE_GPU_MODEL
from stagetrace.digest import digest
from stagetrace.exporters.rows import node_metric_rows

GPUS = 4
MTU = 4096
NIC, NETDEV = "mlx5_0", "eth0"
_PORT_COUNTERS = (
    "port_xmit_data",
    "port_rcv_data",
    "port_xmit_packets",
    "port_rcv_packets",
    "port_xmit_wait",
    "port_rcv_errors",
    "port_xmit_discards",
    "symbol_error",
    "link_downed",
    "link_error_recovery",
)
_HW_COUNTERS = (
    "local_ack_timeout_err",
    "roce_adp_retrans",
    "out_of_sequence",
    "packet_seq_err",
    "np_cnp_sent",
    "rp_cnp_handled",
    "np_ecn_marked_roce_packets",
)


DRIVER_VERSION, CUDA_VERSION = "570.133.20", 12080  # as NVML answers them: the CUDA version 1000 * major + 10 * minor
MEMORY_BYTES = {REFERENCE_GPU_MODEL: H200_MEMORY_BYTES, OTHER_GPU_MODEL: 81559 * 2**20}  # as nvidia-smi reports
SHARED_GPU = GPUS - 1  # the GPU two pods share on a node with shared_gpu
MPS_REPLICAS = 2
MPS_SERVER, MPS_CLIENTS = 4100, (4201, 4202)  # PIDs of the MPS server and of the TTS service and the worker
SHARING_PODS = (("voice", "tts-0", "tts"), ("rag-demo", "worker-0", "worker"))  # namespace, pod, container


def port_files(
    sysfs: Path, device: str, rate: str, netdev: str, counters: dict | None = None, hw_counters: dict | None = None
) -> dict[Path, str]:
    """The files of an mlx5 RoCE device with one active port, under ``<sysfs>/class/infiniband`` (text without
    its newline): the device's firmware and type, the port's link, its netdev, and ``counters/`` and
    ``hw_counters/`` as given (data counters in the kernel's 4-byte words)."""
    root = sysfs / "class" / "infiniband" / device
    port = root / "ports" / "1"
    files = {
        root / "fw_ver": "28.39.1002",
        root / "hca_type": "MT4129",
        root / "node_type": "1: CA",
        port / "rate": rate,
        port / "state": "4: ACTIVE",
        port / "phys_state": "5: LinkUp",
        port / "link_layer": "Ethernet",
        port / "gid_attrs" / "ndevs" / "0": netdev,
    }
    files |= {port / "counters" / name: str(value) for name, value in (counters or {}).items()}
    files |= {port / "hw_counters" / name: str(value) for name, value in (hw_counters or {}).items()}
    return files


class NodeHardware:
    def __init__(
        self,
        host: str,
        directory: str,
        seed: int,
        shared_gpu: bool = False,
        gpu_model: str = REFERENCE_GPU_MODEL,
        start_ns: int | None = None,
    ):
        self.host = host
        self.nvml = Path(directory) / host / "nvml"  # the NVML snapshots the collectors and the detector read
        self.shared_gpu = shared_gpu
        self.root = Path(directory) / host
        self.nic = NIC
        self.gpu_uuids = [
            f"GPU-{u[:8]}-{u[8:12]}-{u[12:16]}-{u[16:20]}-{u[20:32]}"
            for u in (digest([seed, host, g]) for g in range(GPUS))
        ]
        self.port = dict.fromkeys(_PORT_COUNTERS, 0)
        self.hw = dict.fromkeys(_HW_COUNTERS, 0)
        self.gpus = [gpu_snapshot(u, gpu_model, MEMORY_BYTES[gpu_model]) for u in self.gpu_uuids]
        for state in self.gpus:  # weights and KV cache resident from the start
            memory = state["nvmlDeviceGetMemoryInfo"]
            memory["used"] = int(memory["total"] * 0.8)
            memory["free"] = memory["total"] - memory["reserved"] - memory["used"]
        if shared_gpu:  # the TTS service's and the worker's processes on the shared GPU, through MPS
            gpu = self.gpus[SHARED_GPU]
            gpu["nvmlDeviceGetComputeRunningProcesses"] = [process_info(MPS_SERVER, 600 * 2**20)]
            gpu["nvmlDeviceGetMPSComputeRunningProcesses"] = [process_info(pid, 40 * 2**30) for pid in MPS_CLIENTS]
        self._write_static()
        # The kubelet starts with the first scrape: gRPC starts threads, and the node forks its TP ranks first. Only
        # the node that shares a GPU runs one: a gRPC server in every node process doubled the demo's time.
        self.kubelet = (
            RecordedKubelet(self.root / "kubelet" / "kubelet.sock", self.root / "kubelet") if shared_gpu else None
        )
        shared = (
            {
                "kubelet_socket": self.kubelet.socket_path,
                "procfs": self.root / "proc",
                "kubelet_log_dir": self.root / "log",
            }
            if self.kubelet
            else {}
        )
        options = Options(
            host=host, sysfs=self.root / "sys", nvml_fixture=self.nvml, mps_fixture=self.root / "mps", **shared
        )
        self._collectors = build_node(["gpu", "rdma", *(["mps", "kubernetes"] if shared_gpu else [])], options)
        self._nic_collectors = build_node(["rdma"], options)
        # the counters' start: the node's simulated clock's (``pipeline.SimClock``), so its samples lie on that clock
        self._started_ns = time.time_ns() if start_ns is None else start_ns

    # -- what the workload and the faults do
    def allreduce(self, message_bytes: int, ranks: int) -> None:
        wire = 2 * (ranks - 1) * message_bytes // ranks  # a ring all-reduce's bytes per rank
        packets = max(1, -(-wire // MTU))
        self.port["port_xmit_data"] += wire // 4
        self.port["port_rcv_data"] += wire // 4
        self.port["port_xmit_packets"] += packets
        self.port["port_rcv_packets"] += packets

    def nic_timeout(self) -> None:
        self.hw["local_ack_timeout_err"] += 1
        self.hw["roce_adp_retrans"] += 2
        self.port["port_xmit_wait"] += 5_000

    def seq_error(self) -> None:
        """Packets of a remote rank's chunk arrived out of sequence: the responder NAKs them and they are resent."""
        self.hw["out_of_sequence"] += 3

    def decode(self, gpu: int, tokens: int, batch: int) -> None:
        state = self.gpus[gpu]
        utilization = min(100, 20 + 3 * batch)
        state["nvmlDeviceGetUtilizationRates"] = {"gpu": utilization, "memory": utilization // 2}
        state["nvmlDeviceGetPowerUsage"] = 300_000 + 2_000 * utilization  # mW
        state["nvmlDeviceGetTotalEnergyConsumption"] += 350 * tokens  # mJ
        state["nvmlDeviceGetTemperatureV"] = {"NVML_TEMPERATURE_GPU": 45 + utilization // 5}
        state["nvmlDeviceGetClockInfo"] = {"NVML_CLOCK_SM": 1980, "NVML_CLOCK_MEM": 3201}
        state["nvmlDeviceGetCurrentClocksEventReasons"] = 0

    def xid(self, gpu: int, xid: int) -> None:
        """A double-bit ECC error: XID 48 and one uncorrected error, as NVML reports them."""
        state = self.gpus[gpu]
        state["nvmlEventSetWait_v2"].append(xid_event(xid))
        state["nvmlDeviceGetTotalEccErrors"]["NVML_MEMORY_ERROR_TYPE_UNCORRECTED"]["NVML_VOLATILE_ECC"] += 1

    # -- what the collectors read
    def scrape(self, nic_only: bool = False) -> list:
        """One scrape of the host's GPUs, NIC and kubelet (``nic_only``: of its NIC alone), as metric families."""
        self._write_counters()
        if nic_only:
            return list(self._nic_collectors.collect())
        self._write_nvml()
        if self.kubelet:
            self.kubelet.start()
        return list(self._collectors.collect())

    def sample_rows(self, at_ns: int, nic_only: bool = False) -> dict[str, list[tuple]]:
        """One scrape (``scrape``) as metric rows at ``at_ns`` (the node's simulated clock, as its spans)."""
        families = self.scrape(nic_only)
        return node_metric_rows(families, self.host, at_ns, start_ns=self._started_ns)

    def close(self) -> None:
        self._collectors.close()
        if self.kubelet:
            self.kubelet.stop()

    def pods(self) -> dict[str, dict]:
        """The kubelet's answers: ``List`` (pods and the devices each container holds) and
        ``GetAllocatableResources`` (the devices the device plugin advertises), in proto3 JSON form."""
        replicas = MPS_REPLICAS if self.shared_gpu else 1

        def device(uuid: str, replica: int) -> dict:
            ids = [f"{uuid}::{replica}" if self.shared_gpu else uuid]
            return {"resourceName": "nvidia.com/gpu", "deviceIds": ids, "topology": {"nodes": [{"ID": "0"}]}}

        engine = [device(u, 0) for i, u in enumerate(self.gpu_uuids) if not (self.shared_gpu and i == SHARED_GPU)]
        pods = [
            {
                "name": f"{self.host}-engine",
                "namespace": "rag-demo",
                "containers": [{"name": "engine", "devices": engine, "cpuIds": [str(c) for c in range(2, 18)]}],
            }
        ]
        if self.shared_gpu:
            pods += [
                {
                    "name": pod,
                    "namespace": namespace,
                    "containers": [{"name": container, "devices": [device(self.gpu_uuids[SHARED_GPU], replica)]}],
                }
                for replica, (namespace, pod, container) in enumerate(SHARING_PODS)
            ]
        pods.append(
            {
                "name": f"nvidia-device-plugin-{self.host}",
                "namespace": "kube-system",
                "containers": [{"name": "nvidia-device-plugin"}],
            }
        )
        allocatable = {
            "devices": [device(u, r) for u in self.gpu_uuids for r in range(replicas)],
            "cpuIds": [str(c) for c in range(2, 64)],
        }
        return {"List": {"podResources": pods}, "GetAllocatableResources": allocatable}

    def _write_nvml(self) -> None:
        write_nvml_fixture(
            self.nvml, self.gpus, nvmlSystemGetDriverVersion=DRIVER_VERSION, nvmlSystemGetCudaDriverVersion=CUDA_VERSION
        )

    def _write_static(self) -> None:
        self._write_nvml()  # the configuration detector reads it when the node's process starts
        if self.shared_gpu:
            write_answers(self.root / "kubelet", self.pods())
            write_mps_fixture(
                self.root / "mps",
                {
                    "get_server_list": f"{MPS_SERVER}\n",
                    f"get_client_list {MPS_SERVER}": "".join(f"{p}\n" for p in MPS_CLIENTS),
                    "get_default_active_thread_percentage": "50.0\n",
                },
            )
            self._write_tenants()
        for path, text in port_files(self.root / "sys", NIC, "400 Gb/sec (4X NDR)", NETDEV).items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n")

    def _write_tenants(self) -> None:
        """What names the shared GPU's processes' pods on a host: each one's ``/proc/<pid>/cgroup`` (the systemd
        driver's layout, cgroup v2) and ``comm``, and the kubelet's log directory, which names pod UIDs and
        container IDs (``collectors.gpu_tenants``)."""
        daemon = ("kube-system", f"nvidia-device-plugin-{self.host}", "nvidia-device-plugin")  # runs the MPS server
        owners = [
            (MPS_SERVER, "nvidia-cuda-mps-server", daemon),
            *((pid, pod[2], pod) for pid, pod in zip(MPS_CLIENTS, SHARING_PODS)),
        ]
        for pid, comm, (namespace, pod, container) in owners:
            uid = str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{self.host}/{namespace}/{pod}"))
            container_id = hashlib.sha256(f"{uid}/{container}".encode()).hexdigest()
            proc = self.root / "proc" / str(pid)
            proc.mkdir(parents=True, exist_ok=True)
            (proc / "comm").write_text(comm + "\n")
            (proc / "cgroup").write_text(
                f"0::/kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice/cri-containerd-{container_id}.scope\n"
            )
            (self.root / "log" / "pods" / f"{namespace}_{pod}_{uid}" / container).mkdir(parents=True, exist_ok=True)
            (self.root / "log" / "containers").mkdir(parents=True, exist_ok=True)
            (self.root / "log" / "containers" / f"{pod}_{namespace}_{container}-{container_id}.log").touch()

    def _write_counters(self) -> None:
        port = self.root / "sys" / "class" / "infiniband" / NIC / "ports" / "1"
        for folder, counters in (("counters", self.port), ("hw_counters", self.hw)):
            (port / folder).mkdir(exist_ok=True)
            for name, value in counters.items():
                (port / folder / name).write_text(f"{value}\n")
