"""The ethtool collector: the real SIOCETHTOOL ioctl on veth pairs, and mlx5 statistics from a fixture.

veth implements ETHTOOL_GSTATS (``peer_ifindex`` and per-queue XDP/NAPI counters), so the ioctl path
runs against a real driver in network namespaces the tests create, with Debian's ``ethtool -S`` as
the reference. mlx5 NICs cannot exist here: ``tests/fixtures/node/ethtool/statistics.json`` holds the
statistics of the fixture node's 8 RoCE netdevs (those behind ``tests/fixtures/node/sys``'s RDMA
ports) in the names and order mlx5 prints them (kernel ``mlx5/counters.rst``); composed in that
shape, not recorded from a device. PFC is on priority 3; ens2f1np1 (mlx5_3) has pause storms.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stagetrace.collectors.base import REGISTRY, Node, Options, SourceUnavailable
from stagetrace.collectors.ethtool import EthtoolCollector, FixtureSource

FIXTURES = Path(__file__).parent / "fixtures" / "node"
STATISTICS = FIXTURES / "ethtool" / "statistics.json"
ROCE_NETDEVS = ["ens1f0np0", "ens1f1np1", "ens2f0np0", "ens2f1np1", "ens3f0np0", "ens3f1np1", "ens4f0np0", "ens4f1np1"]


def scrape(collector_or_node) -> dict[tuple[str, frozenset], float]:
    node = collector_or_node if isinstance(collector_or_node, Node) else Node([collector_or_node], "node1")
    return {(s.name, frozenset(s.labels.items())): s.value for family in node.collect() for s in family.samples}


def value(scraped, name, **labels) -> float:
    return scraped[(name, frozenset({"host": "node1", **labels}.items()))]


def names(scraped) -> set[str]:
    return {name for name, _ in scraped}


def success(scraped) -> float:
    return value(scraped, "stagetrace_collector_success", collector="ethtool")


def fixture_collector(**options) -> EthtoolCollector:
    return EthtoolCollector(Options(host="node1", sysfs=FIXTURES / "sys", ethtool_fixture=STATISTICS, **options))


# --- mlx5 statistics from the fixture -------------------------------------------------------------


def test_registered_and_enabled_by_default():
    assert REGISTRY["ethtool"] is EthtoolCollector and EthtoolCollector.default_enabled


def test_netdevs_are_those_behind_rdma_ports():
    assert fixture_collector().netdevs() == ROCE_NETDEVS
    assert fixture_collector(netdevs=("ens2f1np1", "ens2f1np1")).netdevs() == ["ens2f1np1"]


def test_mlx5_pfc_discards_and_pause_storms():
    recorded = json.loads(STATISTICS.read_text())
    scraped = scrape(fixture_collector())
    assert success(scraped) == 1
    for netdev in ROCE_NETDEVS:
        stats = recorded[netdev]
        for direction in ("rx", "tx"):
            pfc = {"netdev": netdev, "direction": direction}
            assert (
                value(scraped, "nic_pfc_pause_frames_total", **pfc, priority="3") == stats[f"{direction}_prio3_pause"]
            )
            assert value(scraped, "nic_pfc_pause_duration_seconds_total", **pfc, priority="3") == pytest.approx(
                stats[f"{direction}_prio3_pause_duration"] / 1e6
            )
            assert (
                value(scraped, "nic_pfc_pause_frames_total", **pfc, priority="global")
                == (stats[f"{direction}_global_pause"])
            )
            assert value(scraped, "nic_pfc_pause_duration_seconds_total", **pfc, priority="global") == pytest.approx(
                stats[f"{direction}_global_pause_duration"] / 1e6
            )
            assert value(scraped, "nic_discards_total", **pfc) == stats[f"{direction}_discards_phy"]
        assert value(scraped, "nic_out_of_buffer_total", netdev=netdev) == stats["rx_out_of_buffer"]
        for level in ("warning", "error"):
            assert (
                value(scraped, "nic_pause_storm_events_total", netdev=netdev, level=level)
                == (stats[f"tx_pause_storm_{level}_events"])
            )
    # PFC is only on priority 3, so mlx5 has no pause counters for the others
    priorities = {dict(labels)["priority"] for name, labels in scraped if name == "nic_pfc_pause_frames_total"}
    assert priorities == {"3", "global"}
    assert value(scraped, "nic_pause_storm_events_total", netdev="ens2f1np1", level="error") == 1
    # pause_ctrl_phy also counts the PFC frames: it is not a priority, or sums would count them twice
    pfc_frames = sum(
        v
        for (name, lbl), v in scraped.items()
        if name == "nic_pfc_pause_frames_total" and ("netdev", "ens2f1np1") in lbl
    )
    assert pfc_frames == recorded["ens2f1np1"]["rx_prio3_pause"] + recorded["ens2f1np1"]["tx_prio3_pause"]
    assert not [name for name in names(scraped) if name.startswith("nic_ethtool_")]  # nothing else unless included


def test_include_pattern_exports_other_statistics_once():
    scraped = scrape(fixture_collector(ethtool_include=r"^rx_prio3_|link_down_events"))
    assert value(scraped, "nic_ethtool_rx_prio3_buf_discard_total", netdev="ens2f1np1") == 1841
    assert value(scraped, "nic_ethtool_rx_prio3_pause_transition_total", netdev="ens2f1np1") == 694476
    assert value(scraped, "nic_ethtool_link_down_events_phy_total", netdev="ens2f1np1") == 2
    # rx_prio3_pause matches too, but is already nic_pfc_pause_frames_total: not exported twice
    assert "nic_ethtool_rx_prio3_pause_total" not in names(scraped)
    assert "nic_ethtool_rx_prio3_pause_duration_total" not in names(scraped)


def test_include_pattern_that_is_not_a_regex():
    with pytest.raises(ValueError, match=r"ethtool include pattern '\(' is not a regular expression"):
        fixture_collector(ethtool_include="(")


def test_names_that_sanitize_alike_give_one_series(tmp_path, caplog):
    path = tmp_path / "statistics.json"
    path.write_text(json.dumps({"eth9": {"rx-errors": 1, "rx_errors": 2, "Rx Errors": 3}}))
    collector = EthtoolCollector(
        Options(host="node1", netdevs=("eth9",), ethtool_fixture=path, ethtool_include="(?i)errors")
    )
    with caplog.at_level(logging.WARNING, logger="stagetrace.collectors"):
        scraped = scrape(collector)
    assert value(scraped, "nic_ethtool_rx_errors_total", netdev="eth9") == 1  # the driver's first name wins
    assert len(caplog.records) == 2 and all("nic_ethtool_rx_errors_total" in r.getMessage() for r in caplog.records)


def test_netdev_without_statistics_or_vanished_is_skipped_and_logged_once(tmp_path, caplog):
    path = tmp_path / "statistics.json"
    path.write_text(json.dumps({"eth0": {"rx_out_of_buffer": 7}, "lo": None}))
    node = Node(
        [EthtoolCollector(Options(host="node1", netdevs=("lo", "eth0", "gone0"), ethtool_fixture=path))], "node1"
    )
    with caplog.at_level(logging.WARNING, logger="stagetrace.collectors"):
        first, second = scrape(node), scrape(node)
    for scraped in (first, second):
        assert success(scraped) == 1 and value(scraped, "nic_out_of_buffer_total", netdev="eth0") == 7
    assert sorted(r.getMessage() for r in caplog.records) == [
        "ethtool: skipping netdev gone0: no such netdev",
        "ethtool: skipping netdev lo: its driver exports no statistics",
    ]


def test_no_readable_netdev_is_source_unavailable(tmp_path):
    path = tmp_path / "statistics.json"
    path.write_text(json.dumps({"lo": None}))
    collector = EthtoolCollector(Options(host="node1", netdevs=("lo", "gone0"), ethtool_fixture=path))
    with pytest.raises(
        SourceUnavailable, match=r"^no driver statistics on any netdev \(lo: .*; gone0: no such netdev\)"
    ):
        collector.collect(None)
    assert success(scrape(collector)) == 0


@pytest.mark.parametrize("content", [None, "", "not json", "[1, 2]", '{"eth0": [1]}', '{"eth0": {"rx": "many"}}'])
def test_unusable_fixture_file_is_source_unavailable(tmp_path, content):
    path = tmp_path / "statistics.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SourceUnavailable, match=r"^ethtool fixture .*statistics.json is unusable: [^\n]+$"):
        EthtoolCollector(Options(host="node1", netdevs=("eth0",), ethtool_fixture=path)).collect(None)


def test_no_netdev_at_all_is_source_unavailable(tmp_path):
    (tmp_path / "class" / "net").mkdir(parents=True)
    with pytest.raises(SourceUnavailable, match="no netdev to read"):
        EthtoolCollector(Options(host="node1", sysfs=tmp_path)).collect(None)


# --- the real ioctl on veth pairs in network namespaces -------------------------------------------

CHILD_PRELUDE = """
import json, logging, subprocess, sys
from pathlib import Path
from stagetrace.collectors.base import Node, Options
from stagetrace.collectors.ethtool import EthtoolCollector, IoctlSource
logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)

def scrape(node):
    return [[s.name, s.labels, s.value] for family in node.collect() for s in family.samples]
"""


def _required(message: str):
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


class Pair:
    """A veth pair, ``va`` in namespace ``a`` (10.77.0.1) and ``vb`` in namespace ``b`` (10.77.0.2)."""

    def __init__(self, a: str, b: str, ethtool: str):
        self.a, self.b, self.ethtool = a, b, ethtool

    def run_in(self, namespace: str, code: str) -> tuple[object, str]:
        """Run Python in the namespace (``ip netns exec`` also mounts its /sys); return its JSON output and stderr."""
        done = subprocess.run(
            ["ip", "netns", "exec", namespace, sys.executable, "-c", CHILD_PRELUDE + textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout), done.stderr

    def ethtool_S(self, namespace: str, netdev: str) -> dict[str, int]:
        """Debian's ``ethtool -S``, the reference."""
        text = subprocess.run(
            ["ip", "netns", "exec", namespace, self.ethtool, "-S", netdev], capture_output=True, text=True, check=True
        ).stdout
        stats = {}
        for line in text.splitlines()[1:]:  # after "NIC statistics:"
            name, _, number = line.strip().rpartition(": ")
            stats.setdefault(name, int(number))
        return stats

    def send_udp(self, datagrams: int) -> None:
        self.run_in(
            self.a,
            f"""
            import socket
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                for _ in range({datagrams}):
                    s.sendto(b"x" * 100, ("10.77.0.2", 9))
            print("null")
        """,
        )


@pytest.fixture
def veth(component):
    """A fresh veth pair across two network namespaces, deleted afterwards."""
    ip, ethtool = component("ip", package="iproute2"), component("ethtool", package="ethtool")
    if os.geteuid() != 0:
        _required("creating network namespaces needs root")
    a, b = f"stagetrace-{os.getpid()}-a", f"stagetrace-{os.getpid()}-b"
    steps = [
        [ip, "netns", "add", a],
        [ip, "netns", "add", b],
        [ip, "link", "add", "va", "netns", a, "type", "veth", "peer", "name", "vb", "netns", b],
        # no IPv6, and a static neighbour: the only packets on the pair are the ones a test sends
        [ip, "netns", "exec", a, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6"],
        [ip, "netns", "exec", b, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6"],
        [ip, "-n", a, "addr", "add", "10.77.0.1/24", "dev", "va"],
        [ip, "-n", b, "addr", "add", "10.77.0.2/24", "dev", "vb"],
        [ip, "-n", a, "link", "set", "va", "up"],
        [ip, "-n", b, "link", "set", "vb", "up"],
        # veth counts received packets in its GSTATS only on its NAPI path: a GRO that is asked for
        # (not merely on by default) turns NAPI on, UDP GRO forwarding lets datagrams take it
        [ip, "netns", "exec", b, ethtool, "-K", "vb", "gro", "off"],
        [ip, "netns", "exec", b, ethtool, "-K", "vb", "gro", "on", "rx-udp-gro-forwarding", "on"],
    ]
    try:
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                _required(f"{' '.join(step)} failed: {done.stderr.strip()}")
        b_mac = json.loads(
            subprocess.run([ip, "-n", b, "-j", "link", "show", "vb"], capture_output=True, check=True).stdout
        )
        subprocess.run(
            [
                ip,
                "-n",
                a,
                "neigh",
                "replace",
                "10.77.0.2",
                "lladdr",
                b_mac[0]["address"],
                "dev",
                "va",
                "nud",
                "permanent",
            ],
            check=True,
        )
        yield Pair(a, b, ethtool)
    finally:
        for namespace in (a, b):
            subprocess.run([ip, "netns", "del", namespace], capture_output=True)


def test_ioctl_reads_what_ethtool_S_prints(veth):
    ours, _ = veth.run_in(veth.b, "print(json.dumps(IoctlSource(Path('/sys')).statistics('vb')))")
    reference = veth.ethtool_S(veth.b, "vb")
    assert ours == reference and list(ours) == list(reference)  # same names, same order, same values
    assert "peer_ifindex" in ours and any(name.endswith("_xdp_packets") for name in ours)
    a_link = json.loads(subprocess.run(["ip", "-n", veth.a, "-j", "link", "show", "va"], capture_output=True).stdout)
    assert ours["peer_ifindex"] == a_link[0]["ifindex"]


def test_counters_move_with_traffic_and_match_ethtool(veth):
    collect = """
        node = Node([EthtoolCollector(Options(host="node1", netdevs=("vb",), ethtool_include=r"^rx_queue_0_xdp_(packets|bytes)$"))], "node1")
        print(json.dumps(scrape(node)))
    """

    def packets() -> float:
        samples, _ = veth.run_in(veth.b, collect)
        found = {name: value for name, labels, value in samples if labels.get("netdev") == "vb"}
        assert {name for name, labels, value in samples if labels.get("collector") == "ethtool"} == {
            "stagetrace_collector_success",
            "stagetrace_collector_duration_seconds",
        }
        return found["nic_ethtool_rx_queue_0_xdp_packets_total"]

    before = packets()
    veth.send_udp(25)
    after = packets()
    assert after - before == 25
    assert after == veth.ethtool_S(veth.b, "vb")["rx_queue_0_xdp_packets"]


def test_discovers_the_namespace_netdevs_without_loopback(veth, tmp_path):
    # a sysfs root with only class/net (the namespace's, as `ip netns exec` mounts it): no RDMA ports
    (tmp_path / "class").mkdir()
    (tmp_path / "class" / "net").symlink_to("/sys/class/net")
    discovered, _ = veth.run_in(
        veth.b, f"print(json.dumps(EthtoolCollector(Options(sysfs=Path({str(tmp_path)!r}))).netdevs()))"
    )
    assert discovered == ["vb"]


def test_loopback_and_vanished_netdevs_are_skipped(veth):
    samples, log = veth.run_in(
        veth.b,
        """
        node = Node([EthtoolCollector(Options(host="node1", netdevs=("lo", "vb", "gone0"), ethtool_include="peer_ifindex"))], "node1")
        first = scrape(node)
        subprocess.run(["ip", "link", "del", "vb"], check=True)  # vb vanishes between two scrapes
        print(json.dumps([first, scrape(node)]))
    """,
    )
    first, second = (
        {(name, labels.get("netdev") or labels.get("collector")): value for name, labels, value in s} for s in samples
    )
    assert first[("stagetrace_collector_success", "ethtool")] == 1
    assert ("nic_ethtool_peer_ifindex_total", "vb") in first
    assert second[("stagetrace_collector_success", "ethtool")] == 0
    assert not [key for key in second if key[1] == "vb"]
    assert log.splitlines() == [
        "ethtool: skipping netdev lo: its driver exports no statistics",
        "ethtool: skipping netdev gone0: no such netdev",
        "collector ethtool: no driver statistics on any netdev (lo: its driver exports no statistics; "
        "vb: no such netdev; gone0: no such netdev); choose NICs with STAGETRACE_NETDEVS",
    ]


def test_fixture_and_ioctl_sources_read_the_same_shape(veth, tmp_path):
    """A recording of a real netdev read back through the fixture source gives what the ioctl gives."""
    recorded, _ = veth.run_in(veth.b, "print(json.dumps({'vb': IoctlSource(Path('/sys')).statistics('vb')}))")
    path = tmp_path / "statistics.json"
    path.write_text(json.dumps(recorded))
    assert FixtureSource(path).statistics("vb") == recorded["vb"] == veth.ethtool_S(veth.b, "vb")
