"""NIC driver statistics (PFC pause, discards, pause storms) through the ``SIOCETHTOOL`` ioctl, as ``ethtool -S``.

Per-priority PFC counters exist only there: not in ``/sys/class/net/*/statistics``, and ethtool's
netlink interface has no equivalent of ``ETHTOOL_GSTATS`` (kernel ``ethtool-netlink.rst``). So this
collector asks the driver the way ``ethtool -S`` does, from Python with no binary: ``ETHTOOL_GSSET_INFO``
for the number of statistics, ``ETHTOOL_GSTRINGS`` for their names, ``ETHTOOL_GSTATS`` for their values.

The mlx5 names (kernel ``mlx5/counters.rst``) map to:

- ``rx|tx_prio<N>_pause`` -> ``nic_pfc_pause_frames_total{direction,priority=N}``, and the link-level
  (global) pause frames ``rx|tx_global_pause`` as ``priority="global"``; ``rx|tx_pause_ctrl_phy`` are
  left out (include them by name): they count pause MAC control frames at the PHY, PFC ones too on
  mlx5 by field reports, so a sum over priorities would count those frames twice;
- ``rx|tx_prio<N>_pause_duration`` and ``rx|tx_global_pause_duration`` (µs) -> ``nic_pfc_pause_duration_seconds_total``
  (seconds, Prometheus' base unit, which ``promtool check metrics`` insists on);
- ``rx|tx_discards_phy`` -> ``nic_discards_total{direction}``; ``rx_out_of_buffer`` -> ``nic_out_of_buffer_total``;
- ``tx_pause_storm_warning|error_events`` -> ``nic_pause_storm_events_total{level}``.

Any other statistic whose name matches ``Options.ethtool_include`` (a regular expression, searched)
is exported as ``nic_ethtool_<name>_total{netdev}``, the way the RDMA collector exports every
hw_counter as ``rdma_<file>_total``: one family per statistic, named as ``ethtool -S`` prints it.

Netdevs: ``Options.netdevs``, else those behind RDMA ports, else every non-loopback netdev.
One that vanished (ENODEV) or whose driver has no statistics (``lo``) is skipped, logged once.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import os
import re
import socket
import struct
from pathlib import Path

from stagetrace.collectors.base import (
    COUNTER,
    SYSFS,
    Collector,
    MetricSpec,
    Samples,
    Setting,
    SourceUnavailable,
    comma_list,
    path_or_none,
    register,
)
from stagetrace.collectors.rdma import rdma_netdevs
from stagetrace.environment_variables import STAGETRACE_ETHTOOL_FIXTURE, STAGETRACE_ETHTOOL_INCLUDE, STAGETRACE_NETDEVS

logger = logging.getLogger("stagetrace.collectors.ethtool")

# uapi linux/sockios.h and linux/ethtool.h
SIOCETHTOOL = 0x8946
ETHTOOL_GSTRINGS = 0x1B
ETHTOOL_GSTATS = 0x1D
ETHTOOL_GSSET_INFO = 0x37
ETH_SS_STATS = 1
ETH_GSTRING_LEN = 32
IFNAMSIZ = 16

# Layouts, checked with offsetof() against the uapi headers on x86_64:
# struct ifreq (40 bytes): char ifr_name[16]; then a 24-byte union whose ifr_data pointer is at offset 16.
IFREQ_SIZE = 40
# struct ethtool_sset_info: __u32 cmd, reserved; __u64 sset_mask; __u32 data[] (one per bit set in sset_mask).
SSET_INFO = struct.Struct("=IIQI")
# struct ethtool_gstrings: __u32 cmd, string_set, len; __u8 data[len * ETH_GSTRING_LEN].
GSTRINGS_HEADER = struct.Struct("=III")
# struct ethtool_stats: __u32 cmd, n_stats; __u64 data[n_stats] (data at offset 8, 8-aligned).
GSTATS_HEADER = struct.Struct("=II")

LOOPBACK_TYPE = "772"  # ARPHRD_LOOPBACK in <sysfs>/class/net/<netdev>/type


class NoStatistics(Exception):
    """This netdev has no driver statistics to read now; the message says why (vanished, none in its driver)."""


class IoctlSource:
    """The driver's statistics through ``SIOCETHTOOL``, in this process's network namespace."""

    def __init__(self, sysfs: Path):
        self.sysfs = Path(sysfs)

    def netdevs(self) -> list[str]:
        """Every netdev under ``<sysfs>/class/net`` except loopback ones."""
        try:
            names = sorted(os.listdir(self.sysfs / "class" / "net"))
        except OSError:
            return []
        return [name for name in names if _read_text(self.sysfs / "class" / "net" / name / "type") != LOOPBACK_TYPE]

    def statistics(self, netdev: str) -> dict[str, int]:
        """``{name: value}`` in the driver's order, as ``ethtool -S`` prints them."""
        name = os.fsencode(netdev)
        if not name or len(name) >= IFNAMSIZ:
            raise NoStatistics("no such netdev")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                # A driver's count can change between the three calls (mlx5: channels reconfigured):
                # read again until names and values agree with the count.
                for _ in range(3):
                    count = self._count(sock, name)
                    names = self._names(sock, name, count)
                    values = self._values(sock, name, count) if len(names) == count else []
                    if len(names) == len(values) == count:
                        break
                else:
                    raise NoStatistics("the driver's statistics kept changing while being read")
            except OSError as exc:
                raise NoStatistics(_why(exc)) from None
        stats: dict[str, int] = {}
        for key, value in zip(names, values):
            stats.setdefault(key, value)  # a driver that repeats a name: keep the first, as one series
        return stats

    @staticmethod
    def _ioctl(sock: socket.socket, name: bytes, buffer: ctypes.Array) -> None:
        ifreq = bytearray(IFREQ_SIZE)
        struct.pack_into("16sP", ifreq, 0, name, ctypes.addressof(buffer))
        fcntl.ioctl(sock.fileno(), SIOCETHTOOL, ifreq)

    def _count(self, sock: socket.socket, name: bytes) -> int:
        buffer = ctypes.create_string_buffer(SSET_INFO.size)
        SSET_INFO.pack_into(buffer, 0, ETHTOOL_GSSET_INFO, 0, 1 << ETH_SS_STATS, 0)
        self._ioctl(sock, name, buffer)
        _, _, mask, count = SSET_INFO.unpack_from(buffer)
        if not mask & (1 << ETH_SS_STATS) or count == 0:  # the kernel clears the bit of a set the driver lacks
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        return count

    def _names(self, sock: socket.socket, name: bytes, count: int) -> list[str]:
        # Kernels with commit 7b07be1ff1cb (Dec 2025, backported to stable) answer len 0 when `len` is
        # not the driver's count now; older ones ignore `len` and write all they have: leave room.
        room = _room(count)
        buffer = ctypes.create_string_buffer(GSTRINGS_HEADER.size + room * ETH_GSTRING_LEN)
        GSTRINGS_HEADER.pack_into(buffer, 0, ETHTOOL_GSTRINGS, ETH_SS_STATS, count)
        self._ioctl(sock, name, buffer)
        length = min(GSTRINGS_HEADER.unpack_from(buffer)[2], room)
        return gstrings(buffer.raw[GSTRINGS_HEADER.size : GSTRINGS_HEADER.size + length * ETH_GSTRING_LEN])

    def _values(self, sock: socket.socket, name: bytes, count: int) -> list[int]:
        room = _room(count)  # as for the names
        buffer = ctypes.create_string_buffer(GSTATS_HEADER.size + room * 8)
        GSTATS_HEADER.pack_into(buffer, 0, ETHTOOL_GSTATS, count)
        self._ioctl(sock, name, buffer)
        n_stats = min(GSTATS_HEADER.unpack_from(buffer)[1], room)
        return list(struct.unpack_from(f"={n_stats}Q", buffer, GSTATS_HEADER.size))


def gstrings(raw: bytes) -> list[str]:
    """The names in an ``ETHTOOL_GSTRINGS`` answer: fixed ``ETH_GSTRING_LEN`` slots, each NUL-padded ASCII."""
    entries = (raw[i : i + ETH_GSTRING_LEN] for i in range(0, len(raw), ETH_GSTRING_LEN))
    return [entry.split(b"\0", 1)[0].decode("ascii", "replace") for entry in entries]


class FixtureSource:
    """Recorded statistics for NICs that cannot exist here (mlx5 in tests and the demo).

    The file is JSON ``{netdev: {name: value}}``, each netdev's statistics in the order ``ethtool -S``
    prints them; a netdev mapped to ``null`` has none (as ``lo``), one that is absent has vanished.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._loaded: tuple[tuple[int, int], dict] | None = None

    def _recorded(self) -> dict:
        try:
            stat = self.path.stat()
            if self._loaded is None or self._loaded[0] != (stat.st_mtime_ns, stat.st_size):
                recorded = json.loads(self.path.read_text())
                if not isinstance(recorded, dict):
                    raise ValueError("not a JSON object of netdevs")
                self._loaded = ((stat.st_mtime_ns, stat.st_size), recorded)
        except (OSError, ValueError) as exc:
            raise SourceUnavailable(f"ethtool fixture {self.path} is unusable: {exc}") from None
        return self._loaded[1]

    def netdevs(self) -> list[str]:
        return list(self._recorded())

    def statistics(self, netdev: str) -> dict[str, int]:
        recorded = self._recorded()
        if netdev not in recorded:
            raise NoStatistics("no such netdev")
        if not recorded[netdev]:
            raise NoStatistics("its driver exports no statistics")
        try:
            return {str(name): int(value) for name, value in recorded[netdev].items()}
        except (AttributeError, TypeError, ValueError):
            raise SourceUnavailable(
                f"ethtool fixture {self.path} is unusable: {netdev} is not an object of numbers"
            ) from None


def _room(count: int) -> int:
    """Entries to allocate for ``count`` statistics, with room for a driver whose count grew meanwhile."""
    return count + max(count, 64)


def _read_text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _why(exc: OSError) -> str:
    if exc.errno == errno.ENODEV:
        return "no such netdev"
    if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
        return "its driver exports no statistics"
    return exc.strerror or str(exc)


LABELS = ("netdev",)
PFC_LABELS = ("netdev", "direction", "priority")

PFC_PAUSE_FRAMES = MetricSpec(
    "nic_pfc_pause_frames_total",
    COUNTER,
    "Pause frames per priority (mlx5 rx|tx_prio<N>_pause); "
    'priority="global": link-level pause frames (rx|tx_global_pause).',
    PFC_LABELS,
)
PFC_PAUSE_DURATION = MetricSpec(
    "nic_pfc_pause_duration_seconds_total",
    COUNTER,
    "Time paused per priority (mlx5 rx|tx_prio<N>_pause_duration, in microseconds there; "
    'priority="global": rx|tx_global_pause_duration).',
    PFC_LABELS,
    "seconds",
)
DISCARDS = MetricSpec(
    "nic_discards_total",
    COUNTER,
    "Packets the port dropped for lack of buffers, i.e. congestion (mlx5 rx|tx_discards_phy).",
    ("netdev", "direction"),
)
OUT_OF_BUFFER = MetricSpec(
    "nic_out_of_buffer_total",
    COUNTER,
    "Packets dropped because a receive queue had no software buffers (mlx5 rx_out_of_buffer).",
    LABELS,
)
PAUSE_STORMS = MetricSpec(
    "nic_pause_storm_events_total",
    COUNTER,
    'Pause storms: level="warning" the port paused too long, "error" it timed out and stopped sending pause frames '
    "(mlx5 tx_pause_storm_warning|error_events).",
    ("netdev", "level"),
)

# (full-match pattern of the driver's name, spec, constant labels); named groups fill the other labels.
# The driver's durations are microseconds; the series are in seconds.
SCALE = {PFC_PAUSE_DURATION: 1e-6}

MAPPED: tuple[tuple[re.Pattern, MetricSpec, dict[str, str]], ...] = tuple(
    (re.compile(pattern), spec, constant)
    for pattern, spec, constant in (
        (r"(?P<direction>rx|tx)_prio(?P<priority>[0-7])_pause", PFC_PAUSE_FRAMES, {}),
        (r"(?P<direction>rx|tx)_global_pause", PFC_PAUSE_FRAMES, {"priority": "global"}),
        (r"(?P<direction>rx|tx)_prio(?P<priority>[0-7])_pause_duration", PFC_PAUSE_DURATION, {}),
        (r"(?P<direction>rx|tx)_global_pause_duration", PFC_PAUSE_DURATION, {"priority": "global"}),
        (r"(?P<direction>rx|tx)_discards_phy", DISCARDS, {}),
        (r"rx_out_of_buffer", OUT_OF_BUFFER, {}),
        (r"tx_pause_storm_(?P<level>warning|error)_events", PAUSE_STORMS, {}),
    )
)

_NAME_UNSAFE = re.compile(r"[^a-z0-9_]+")


def included_spec(stat: str) -> MetricSpec:
    """``nic_ethtool_<name>_total{netdev}`` for a statistic selected by the include pattern."""
    name = _NAME_UNSAFE.sub("_", stat.lower()).strip("_")
    return MetricSpec(f"nic_ethtool_{name}_total", COUNTER, f"Driver statistic {stat} (ethtool -S).", LABELS)


NETDEVS = Setting(
    "netdevs",
    comma_list,
    "",
    env=STAGETRACE_NETDEVS,
    flag="--netdevs",
    metavar="LIST",
    help="comma-separated netdevs the ethtool collector reads",
    shown_default="those behind RDMA ports, else every non-loopback one",
)
INCLUDE = Setting(
    "ethtool_include",
    str,
    "",
    env=STAGETRACE_ETHTOOL_INCLUDE,
    flag="--ethtool-include",
    metavar="REGEX",
    help="also export every ethtool statistic whose name this regular expression matches",
)
FIXTURE = Setting(
    "ethtool_fixture",
    path_or_none,
    env=STAGETRACE_ETHTOOL_FIXTURE,
    flag="--ethtool-fixture",
    metavar="FILE",
    help="recorded ethtool statistics instead of the ioctl",
)


@register
class EthtoolCollector(Collector):
    """PFC pause, discard and pause-storm counters of the NICs that carry RDMA traffic."""

    name = "ethtool"
    settings = (SYSFS, NETDEVS, INCLUDE, FIXTURE)

    def __init__(self, options):
        super().__init__(options)
        self.source = FixtureSource(options.ethtool_fixture) if options.ethtool_fixture else IoctlSource(options.sysfs)
        try:
            self.include = re.compile(options.ethtool_include) if options.ethtool_include else None
        except re.error as exc:
            pattern = options.ethtool_include
            raise ValueError(f"ethtool include pattern {pattern!r} is not a regular expression: {exc}") from None
        # statistic name -> (spec, labels from the name) or None: decided once per name, not per scrape
        self._plan: dict[str, tuple[MetricSpec, dict[str, str]] | None] = {}
        self._included_names: dict[str, str] = {}  # metric name -> the statistic that owns it
        self._skipped: dict[str, str] = {}  # netdev -> why, so that each is logged once
        self._gid_index: dict[str, str] = {}  # RDMA port directory -> the GID index that names its netdev

    def netdevs(self) -> list[str]:
        if self.options.netdevs:
            return list(dict.fromkeys(self.options.netdevs))
        behind_rdma = sorted(set(rdma_netdevs(self.options.sysfs, self._gid_index).values()))
        return behind_rdma or self.source.netdevs()

    def collect(self, out: Samples) -> None:
        netdevs = self.netdevs()
        if not netdevs:
            raise SourceUnavailable(
                "no netdev to read: none given, none behind RDMA ports "
                f"and none but loopback under {self.options.sysfs}/class/net"
            )
        skipped: dict[str, str] = {}
        for netdev in netdevs:
            try:
                stats = self.source.statistics(netdev)
            except NoStatistics as exc:
                skipped[netdev] = str(exc)
                continue
            for stat, value in stats.items():
                planned = self._planned(stat)
                if planned is not None:
                    out.add(planned[0], value * SCALE.get(planned[0], 1), netdev=netdev, **planned[1])
        previously_skipped, self._skipped = self._skipped, skipped
        if len(skipped) == len(netdevs):
            reasons = "; ".join(f"{netdev}: {why}" for netdev, why in skipped.items())
            raise SourceUnavailable(
                f"no driver statistics on any netdev ({reasons}); choose NICs with STAGETRACE_NETDEVS"
            )
        for netdev, why in skipped.items():
            if previously_skipped.get(netdev) != why:
                logger.warning("ethtool: skipping netdev %s: %s", netdev, why)

    def _planned(self, stat: str) -> tuple[MetricSpec, dict[str, str]] | None:
        if stat in self._plan:
            return self._plan[stat]
        planned = None
        for pattern, spec, constant in MAPPED:
            if match := pattern.fullmatch(stat):
                planned = (spec, {**match.groupdict(), **constant})
                break
        else:
            if self.include is not None and self.include.search(stat):
                spec = included_spec(stat)
                owner = self._included_names.setdefault(spec.name, stat)
                if owner == stat:
                    planned = (spec, {})
                else:
                    logger.warning(
                        "ethtool: statistic %s is left out: its name %s is already %s's", stat, spec.name, owner
                    )
        self._plan[stat] = planned
        return planned
