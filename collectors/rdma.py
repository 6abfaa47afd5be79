"""RDMA port counters (mlx5 RoCE/InfiniBand and any verbs driver) from ``<sysfs>/class/infiniband``.

Per port ``<device>/ports/<n>/``: the PMA counters in ``counters/`` (byte counters count 4-byte
words, so they are multiplied by 4), every driver counter in ``hw_counters/`` as
``rdma_<file>_total``, the link's ``rate``, ``state`` and ``phys_state``, and ``rdma_port_info``
with the port's netdev (from ``gid_attrs/ndevs``), link layer, the device's firmware and HCA type, and
the port's rail.

Rails: one port per rail per host, rail N joining NIC N of every host. ``--rdma-rails``
(``STAGETRACE_RDMA_RAILS``) lists them as ``NAME=DEVICE[:PORT]`` or bare ``DEVICE[:PORT]`` (port 1 when
left out; a bare entry's rail is ``DEVICE/PORT``), e.g. ``rail0=mlx5_0,rail1=mlx5_3:1``; a port not listed
is no rail (``rail=""``). Without a list every port is a rail named ``<device>/<port>``.

A file that is missing, reads ``N/A (no PMA)`` (i40iw and other drivers without a PMA) or that the
driver refuses (EINVAL, EPERM, EOPNOTSUPP, ...) is skipped, never the whole device: procfs, which
node_exporter uses, drops the device there instead, and an operator sees every counter vanish.

The files are held open between scrapes and read with one ``pread`` each (``collectors.sysfs``): a scrape of an
8-port mlx5 node reads 472 files.
"""

from __future__ import annotations

import logging
import math
import os
import re
from functools import lru_cache

from stagetrace.collectors.base import (
    COUNTER,
    GAUGE,
    INFO,
    SYSFS,
    Collector,
    MetricSpec,
    Samples,
    Setting,
    SourceUnavailable,
    register,
)
from stagetrace.collectors.sysfs import HeldFiles, read_once
from stagetrace.environment_variables import STAGETRACE_RDMA_RAILS

logger = logging.getLogger("stagetrace.collectors")

LABELS = ("device", "port")


def _counter(name: str, help: str, unit: str = "") -> MetricSpec:
    return MetricSpec(name, COUNTER, help, LABELS, unit)


# counters/<file> -> spec: the PMA PortCounters of the InfiniBand spec, named as issue 4 asks.
PORT_COUNTERS: dict[str, MetricSpec] = {
    "port_xmit_data": _counter(
        "rdma_port_transmit_bytes_total", "Data bytes transmitted (port_xmit_data x 4).", "bytes"
    ),
    "port_rcv_data": _counter("rdma_port_receive_bytes_total", "Data bytes received (port_rcv_data x 4).", "bytes"),
    "port_xmit_packets": _counter("rdma_port_transmit_packets_total", "Packets transmitted on all VLs."),
    "port_rcv_packets": _counter("rdma_port_receive_packets_total", "Packets received on all VLs."),
    "unicast_xmit_packets": _counter("rdma_port_unicast_transmit_packets_total", "Unicast packets transmitted."),
    "unicast_rcv_packets": _counter("rdma_port_unicast_receive_packets_total", "Unicast packets received."),
    "multicast_xmit_packets": _counter("rdma_port_multicast_transmit_packets_total", "Multicast packets transmitted."),
    "multicast_rcv_packets": _counter("rdma_port_multicast_receive_packets_total", "Multicast packets received."),
    "port_xmit_wait": _counter(
        "rdma_port_transmit_wait_total", "Ticks during which the port had data to send but sent none (back-pressure)."
    ),
    "port_rcv_errors": _counter("rdma_port_receive_errors_total", "Packets received with an error."),
    "port_xmit_discards": _counter(
        "rdma_port_transmit_discards_total", "Outbound packets discarded because the port was down or congested."
    ),
    "port_rcv_remote_physical_errors": _counter(
        "rdma_port_receive_remote_physical_errors_total", "Packets received marked with the EBP delimiter."
    ),
    "port_rcv_switch_relay_errors": _counter(
        "rdma_port_receive_switch_relay_errors_total", "Packets discarded because they could not be forwarded."
    ),
    "port_xmit_constraint_errors": _counter(
        "rdma_port_transmit_constraint_errors_total", "Packets not sent because of outbound partition or filtering."
    ),
    "port_rcv_constraint_errors": _counter(
        "rdma_port_receive_constraint_errors_total", "Packets discarded because of inbound partition or filtering."
    ),
    "symbol_error": _counter("rdma_symbol_errors_total", "Minor link errors detected on one or more physical lanes."),
    "link_downed": _counter("rdma_link_downed_total", "Times link error recovery failed and the link went down."),
    "link_error_recovery": _counter("rdma_link_error_recovery_total", "Times link error recovery completed."),
    "local_link_integrity_errors": _counter(
        "rdma_local_link_integrity_errors_total", "Times local physical errors exceeded the threshold."
    ),
    "excessive_buffer_overrun_errors": _counter(
        "rdma_excessive_buffer_overrun_errors_total",
        "Times consecutive receive buffer overruns exceeded the threshold.",
    ),
    "VL15_dropped": _counter(
        "rdma_vl15_dropped_total", "Incoming VL15 (subnet management) packets dropped for lack of buffers."
    ),
}
# The data counters count 4-byte words ("divided by 4 (lanes)", sysfs-class-infiniband).
WORD_COUNTERS = {"port_xmit_data", "port_rcv_data"}

# hw_counters/<file> -> help, after NVIDIA's "Understanding mlx5 Linux Counters and Status Parameters".
HW_COUNTER_HELP = {
    "rx_write_requests": "RDMA write requests received.",
    "rx_read_requests": "RDMA read requests received.",
    "rx_atomic_requests": "Atomic requests received.",
    "rx_dct_connect": "DCT connect requests received.",
    "out_of_buffer": "Packets dropped because a receive queue had no receive WQE posted.",
    "out_of_sequence": "Out-of-sequence packets received.",
    "duplicate_request": "Duplicate requests received (the requester retransmitted).",
    "rnr_nak_retry_err": "RNR NAKs received: the responder had no receive WQE posted.",
    "packet_seq_err": "Packet sequence error NAKs received.",
    "implied_nak_seq_err": "Responses that implied a lost packet (read or atomic response out of order).",
    "local_ack_timeout_err": "Times a QP's ack timer expired before an ack arrived (recoverable by retransmission).",
    "rp_cnp_ignored": "CNPs received and ignored by the reaction point (stays 0 when RoCE congestion control is on).",
    "rp_cnp_handled": "CNPs handled by the reaction point to slow its transmission.",
    "np_ecn_marked_roce_packets": "ECN-marked RoCE packets received by the notification point (congestion on the path).",
    "np_cnp_sent": "CNPs sent by the notification point in answer to ECN-marked packets.",
    "resp_local_length_error": "Responder local length errors.",
    "resp_cqe_error": "Responder completions with an error.",
    "req_cqe_error": "Requester completions with an error.",
    "req_remote_invalid_request": "Remote invalid request errors seen by the requester.",
    "req_remote_access_errors": "Remote access errors seen by the requester.",
    "resp_remote_access_errors": "Remote access errors on the responder.",
    "resp_cqe_flush_error": "Responder completions flushed with an error (QP in error state).",
    "req_cqe_flush_error": "Requester completions flushed with an error (QP in error state).",
    "req_transport_retries_exceeded": "Requests that exhausted their transport retries; the QP went to error.",
    "req_rnr_retries_exceeded": "Requests that exhausted their RNR retries; the QP went to error.",
    "roce_adp_retrans": "RoCE adaptive retransmissions.",
    "roce_adp_retrans_to": "RoCE adaptive retransmission timeouts.",
    "roce_slow_restart": "Times RoCE slow restart was used.",
    "roce_slow_restart_cnps": "CNPs generated by RoCE slow restart.",
    "roce_slow_restart_trans": "Times a QP entered the RoCE slow-restart state.",
    "rx_icrc_encapsulated": "RoCE packets received with an ICRC error.",
}

# mlx5 reads its Q counters as 32-bit values (be32_to_cpu in counters.c): they wrap.
_WRAPS_AT_32_BITS = {
    "rx_write_requests",
    "rx_read_requests",
    "rx_atomic_requests",
    "rx_dct_connect",
    "out_of_buffer",
    "out_of_sequence",
    "duplicate_request",
    "rnr_nak_retry_err",
    "packet_seq_err",
    "implied_nak_seq_err",
    "local_ack_timeout_err",
}

# hw_counters/lifespan is the counters' refresh period in ms, a setting and not a counter.
_NOT_COUNTERS = {"lifespan"}

RATE = MetricSpec(
    "rdma_port_rate_bytes_per_second", GAUGE, "Port data rate (active width x speed).", LABELS, "bytes_per_second"
)
STATE = MetricSpec(
    "rdma_port_state", GAUGE, "Logical state: 1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER.", LABELS
)
PHYSICAL_STATE = MetricSpec(
    "rdma_port_physical_state",
    GAUGE,
    "Physical state: 2 Polling, 3 Disabled, 5 LinkUp, 6 LinkErrorRecovery, ...",
    LABELS,
)
INFO_SPEC = MetricSpec(
    "rdma_port_info", INFO, "RDMA port: its netdev, link layer, firmware, HCA type and rail.", LABELS
)

_RAIL_FORMS = "write NAME=DEVICE[:PORT] or DEVICE[:PORT], comma-separated, e.g. rail0=mlx5_0,rail1=mlx5_1:1"
_DEVICE_NAME = re.compile(r"[^\s=:/,]+")


def parse_rails(text: str) -> tuple[tuple[str, str, str], ...]:
    """``rail0=mlx5_0,mlx5_1:2`` -> ``(("rail0", "mlx5_0", "1"), ("mlx5_1/2", "mlx5_1", "2"))``: (rail, device, port).

    Empty text is no list (every port is a rail). ValueError, in one line that says what to write, for an
    entry without a name or a device, a port that is not a number, a port in two rails, or a rail of two ports.
    """
    rails: list[tuple[str, str, str]] = []
    rail_of: dict[tuple[str, str], str] = {}
    port_of: dict[str, tuple[str, str]] = {}
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        name, equals, target = (part.strip() for part in entry.rpartition("=")) if "=" in entry else ("", "", entry)
        if equals and not name:
            raise ValueError(f"rail entry {entry!r} has no rail name before '=': {_RAIL_FORMS}")
        if "=" in name:
            raise ValueError(f"rail entry {entry!r} has more than one '=': {_RAIL_FORMS}")
        device, colon, port = target.partition(":")
        if not device:
            raise ValueError(f"rail entry {entry!r} names no RDMA device: {_RAIL_FORMS}")
        if not _DEVICE_NAME.fullmatch(device):
            raise ValueError(f"rail entry {entry!r}: {device!r} is not a device name as in /sys/class/infiniband")
        if colon and not (port.isascii() and port.isdigit() and int(port) >= 1):
            raise ValueError(f"rail entry {entry!r}: port {port!r} is not a port number (1, 2, ...), e.g. {device}:1")
        port = str(int(port)) if colon else "1"
        name = name or f"{device}/{port}"
        if (device, port) in rail_of:
            other = rail_of[(device, port)]
            where = "twice" if other == name else f"in two rails, {other!r} and {name!r}"
            raise ValueError(f"port {device}:{port} is listed {where}: a port belongs to one rail")
        if name in port_of:
            first = ":".join(port_of[name])
            raise ValueError(f"rail {name!r} has two ports, {first} and {device}:{port}: a host has one port per rail")
        rail_of[(device, port)], port_of[name] = name, (device, port)
        rails.append((name, device, port))
    return tuple(rails)


RAILS = Setting(
    "rails",
    parse_rails,
    "",
    env=STAGETRACE_RDMA_RAILS,
    flag="--rdma-rails",
    metavar="LIST",
    help="RDMA ports as rails, comma-separated NAME=DEVICE[:PORT] or DEVICE[:PORT] (rail DEVICE/PORT, port 1 "
    "unless given); a port not listed is no rail",
    shown_default="every port is a rail named DEVICE/PORT",
)

_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


@lru_cache(maxsize=None)
def hw_counter_spec(file: str) -> MetricSpec:
    """The spec of ``hw_counters/<file>``: ``rdma_<file>_total``, described when the file is a known mlx5 counter."""
    help = HW_COUNTER_HELP.get(file.removeprefix("vport_"), f"Driver counter hw_counters/{file}.")
    if file.removeprefix("vport_") in _WRAPS_AT_32_BITS:
        help += " 32-bit on mlx5: wraps."
    return _counter(f"rdma_{_NAME_UNSAFE.sub('_', file)}_total", help)


def _list(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _number(text: str | None) -> int | None:
    """A counter value; None for ``N/A (no PMA)`` and anything else that is not an unsigned 64-bit number.

    The kernel prints counters as plain decimal u64: ``int()`` alone would also take ``-5``, ``1_000`` and
    thousands of digits (a float overflow in the exposition), none of which a counter file holds.
    """
    # isascii() and isdigit(): 0-9 only, and faster than a regex on every file of every scrape
    if not text or len(text) > 20 or not (text.isascii() and text.isdigit()):
        return None
    value = int(text)
    return value if value < 1 << 64 else None


def _state_id(text: str | None) -> int | None:
    """``4: ACTIVE`` -> 4."""
    return _number(text.partition(":")[0]) if text else None


def _rate_bytes_per_second(text: str | None) -> float | None:
    """``400 Gb/sec (4X NDR)`` -> 5e10; procfs converts the same way (Gb/s x 125000000)."""
    if not text:
        return None
    try:
        rate = float(text.split()[0]) * 125_000_000
    except ValueError:
        return None
    return rate if math.isfinite(rate) and rate >= 0 else None  # float() also takes "nan", "inf", "-1"


def _port_netdev(port_dir: str, link_layer: str, gid_index: dict[str, str] | None = None) -> str:
    """The netdev of a RoCE port: the first GID that names one (unused GID indexes answer EINVAL).

    ``gid_index`` (port directory -> GID index) remembers which index named it, so that a collector's later
    scrapes read that one file instead of listing up to 255 indexes; looked for anew when it names none.
    """
    if link_layer != "Ethernet":  # InfiniBand GIDs have no netdev: every index would answer EINVAL
        return ""
    ndevs = f"{port_dir}/gid_attrs/ndevs"
    known = gid_index.get(port_dir) if gid_index is not None else None
    if known is not None and (netdev := read_once(f"{ndevs}/{known}")):
        return netdev
    for index in sorted(_list(ndevs), key=lambda name: int(name) if name.isdigit() else 1 << 30):
        netdev = read_once(f"{ndevs}/{index}")
        if netdev:
            if gid_index is not None:
                gid_index[port_dir] = index
            return netdev
    return ""


def _ports(root: str):
    """Every (device, port, port directory) under ``<sysfs>/class/infiniband``."""
    for device in _list(root):
        ports = f"{root}/{device}/ports"
        for port in _list(ports):
            yield device, port, f"{ports}/{port}"


def _infiniband_root(sysfs) -> str:
    root = os.path.join(os.fspath(sysfs), "class", "infiniband")
    if not os.path.isdir(root):
        raise SourceUnavailable(
            f"{root} does not exist: no RDMA device or driver on this host (--sysfs sets the sysfs root)"
        )
    return root


def rdma_netdevs(sysfs="/sys", gid_index: dict[str, str] | None = None) -> dict[tuple[str, str], str]:
    """``{(device, port): netdev}`` of every RDMA port that has one (RoCE): ``{("mlx5_0", "1"): "ens1f0np0"}``.
    ``gid_index``: a dict the caller keeps between calls, as :func:`_port_netdev` takes it."""
    try:
        root = _infiniband_root(sysfs)
    except SourceUnavailable:
        return {}
    found = {}
    for device, port, port_dir in _ports(root):
        netdev = _port_netdev(port_dir, read_once(f"{port_dir}/link_layer") or "", gid_index)
        if netdev:
            found[(device, port)] = netdev
    return found


@register
class RdmaCollector(Collector):
    """RDMA NIC ports from sysfs, node_exporter's infiniband collector with the driver's hw_counters."""

    name = "rdma"
    settings = (SYSFS, RAILS)

    def __init__(self, options):
        super().__init__(options)
        self._missing_rails: tuple[str, ...] = ()  # listed rails whose port is not under sysfs, as last logged
        self._files = HeldFiles()  # every counter file, held open between scrapes
        self._gid_index: dict[str, str] = {}  # port directory -> the GID index that named its netdev

    def rail(self, device: str, port: str) -> str:
        """The port's rail: as listed in ``rails``, "" for a port not listed, ``<device>/<port>`` without a list."""
        rails = self.options.rails
        if not rails:
            return f"{device}/{port}"
        return next((name for name, d, p in rails if (d, p) == (device, port)), "")

    def collect(self, out: Samples) -> None:
        root = _infiniband_root(self.options.sysfs)
        devices: dict[str, tuple[str, str]] = {}
        seen: set[tuple[str, str]] = set()
        read: set[str] = set()  # the directories read this scrape: the rest are gone, and their files let go
        for device, port, port_dir in _ports(root):
            if device not in devices:
                read.add(device_dir := f"{root}/{device}")
                about = self._files.read(device_dir, ("fw_ver", "hca_type"))
                devices[device] = (about.get("fw_ver") or "", about.get("hca_type") or "")
            self._collect_port(out, device, port, port_dir, *devices[device], self.rail(device, port))
            read.update((port_dir, f"{port_dir}/counters", f"{port_dir}/hw_counters"))
            seen.add((device, port))
        self._files.forget_except(read)
        missing = tuple(f"{name}={d}:{p}" for name, d, p in self.options.rails if (d, p) not in seen)
        if missing and missing != self._missing_rails:  # a typo in --rdma-rails, or a port gone: say so once
            logger.warning("rdma: rails name ports that are not under %s: %s", root, ", ".join(missing))
        self._missing_rails = missing

    def close(self) -> None:
        self._files.close()

    def _collect_port(
        self, out: Samples, device: str, port: str, port_dir: str, fw_ver: str, hca_type: str, rail: str
    ) -> None:
        files, labels = self._files, (device, port)
        for file, text in files.read(f"{port_dir}/counters", keep=PORT_COUNTERS.__contains__).items():
            if (value := _number(text)) is not None:
                out.add_series(PORT_COUNTERS[file], labels, value * 4 if file in WORD_COUNTERS else value)
        for file, text in files.read(f"{port_dir}/hw_counters", keep=lambda f: f not in _NOT_COUNTERS).items():
            if (value := _number(text)) is not None:
                out.add_series(hw_counter_spec(file), labels, value)
        link = files.read(port_dir, ("rate", "state", "phys_state", "link_layer"))
        for spec, value in (
            (RATE, _rate_bytes_per_second(link.get("rate"))),
            (STATE, _state_id(link.get("state"))),
            (PHYSICAL_STATE, _state_id(link.get("phys_state"))),
        ):
            if value is not None:
                out.add(spec, value, device=device, port=port)
        link_layer = link.get("link_layer") or ""
        netdev = _port_netdev(port_dir, link_layer, self._gid_index)
        out.add(
            INFO_SPEC,
            {"netdev": netdev, "link_layer": link_layer, "fw_ver": fw_ver, "hca_type": hca_type, "rail": rail},
            device=device,
            port=port,
        )
