"""A simulated node's hardware, exposed the way real hardware is, and read by the real collectors.

The NIC is a sysfs tree in the ``/sys/class/infiniband`` layout (mlx5 port and hw counters, the
data counters in 4-byte words as the kernel keeps them); the GPUs are NVML snapshots in the gpu
collector's recorded-fixture format. Every host has its own tree, including the remote host of a
two-host TP group, and its samples carry its own ``host.name``. The workload and the faults advance the counters; sampling
writes both out and scrapes them with the ``rdma`` and ``gpu`` collectors into metric rows.
"""

from __future__ import annotations

import time
from pathlib import Path

from stagetrace.collectors import build_node
from stagetrace.collectors.base import Options
from stagetrace.collectors.nvml import gpu_snapshot, write_nvml_fixture, xid_event
from stagetrace.digest import digest
from stagetrace.exporters.clickhouse import metric_rows

GPUS = 4
MTU = 4096
NIC, NETDEV = "mlx5_0", "eth0"
_PORT_COUNTERS = ("port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets", "port_xmit_wait",
                  "port_rcv_errors", "port_xmit_discards", "symbol_error", "link_downed", "link_error_recovery")  # fmt: skip
_HW_COUNTERS = ("local_ack_timeout_err", "roce_adp_retrans", "out_of_sequence", "packet_seq_err",
                "np_cnp_sent", "rp_cnp_handled", "np_ecn_marked_roce_packets")  # fmt: skip


class NodeHardware:
    def __init__(self, host: str, directory: str, seed: int):
        self.host = host
        self.root = Path(directory) / host
        self.nic = NIC
        self.gpu_uuids = [f"GPU-{u[:8]}-{u[8:12]}-{u[12:16]}-{u[16:20]}-{u[20:32]}" for u in
                          (digest([seed, host, g]) for g in range(GPUS))]  # fmt: skip
        self.port = dict.fromkeys(_PORT_COUNTERS, 0)
        self.hw = dict.fromkeys(_HW_COUNTERS, 0)
        self.gpus = [gpu_snapshot(u) for u in self.gpu_uuids]
        for state in self.gpus:  # weights and KV cache resident from the start
            memory = state["nvmlDeviceGetMemoryInfo"]
            memory["used"] = int(memory["total"] * 0.8)
            memory["free"] = memory["total"] - memory["reserved"] - memory["used"]
        self._write_static()
        options = Options(host=host, sysfs=self.root / "sys", nvml_fixture=self.root / "nvml")
        self._collectors = build_node(["gpu", "rdma"], options)
        self._nic_collectors = build_node(["rdma"], options)
        self._started_ns = time.time_ns()

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
    def sample_rows(self, nic_only: bool = False) -> dict[str, list[tuple]]:
        """One scrape of the host's GPUs and NIC (``nic_only``: of its NIC alone), as metric rows."""
        self._write_counters()
        if not nic_only:
            write_nvml_fixture(self.root / "nvml", self.gpus)
        now = time.time_ns()
        collectors = self._nic_collectors if nic_only else self._collectors
        return metric_rows(collectors.collect(), self.host, now, start_ns=self._started_ns)

    def _write_static(self) -> None:
        device = self.root / "sys" / "class" / "infiniband" / NIC
        port = device / "ports" / "1"
        files = {
            device / "fw_ver": "28.39.1002", device / "hca_type": "MT4129", device / "node_type": "1: CA",
            port / "rate": "400 Gb/sec (4X NDR)", port / "state": "4: ACTIVE", port / "phys_state": "5: LinkUp",
            port / "link_layer": "Ethernet", port / "gid_attrs" / "ndevs" / "0": NETDEV,
        }  # fmt: skip
        for path, text in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n")

    def _write_counters(self) -> None:
        port = self.root / "sys" / "class" / "infiniband" / NIC / "ports" / "1"
        for folder, counters in (("counters", self.port), ("hw_counters", self.hw)):
            (port / folder).mkdir(exist_ok=True)
            for name, value in counters.items():
                (port / folder / name).write_text(f"{value}\n")
