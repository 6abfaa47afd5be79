"""The RDMA collector on the committed 8-port mlx5 sysfs fixture, and against node_exporter on the same tree."""

import gc
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from stagetrace.collectors.base import Node, Options
from stagetrace.cli import build_parser
from stagetrace.collectors.rdma import PORT_COUNTERS, RdmaCollector, parse_rails, rdma_netdevs
from stagetrace.exporters.prometheus import exposition, registry_for

SYSFS = Path(__file__).parent / "fixtures" / "node" / "sys"
IB = SYSFS / "class" / "infiniband"


def scrape(sysfs: Path, node: Node | None = None):
    """A registry over a one-collector node; ``get_sample_value`` runs a fresh scrape each call."""
    node = node or Node([RdmaCollector(Options(sysfs=sysfs, host="node-a"))], "node-a")
    return registry_for(node)


def value(registry, name: str, device: str, port: str = "1", **labels):
    return registry.get_sample_value(name, {"host": "node-a", "device": device, "port": port, **labels})


def file_value(device: str, path: str) -> int:
    return int((IB / device / "ports" / "1" / path).read_text())


@pytest.fixture
def copied_sysfs(tmp_path) -> Path:
    """A writable copy of the fixture tree, for edge cases that must not touch the committed one."""
    shutil.copytree(SYSFS, tmp_path / "sys")
    return tmp_path / "sys"


def test_every_port_of_the_fixture_node_is_collected():
    registry = scrape(SYSFS)
    assert registry.get_sample_value("stagetrace_collector_success", {"host": "node-a", "collector": "rdma"}) == 1
    for i in range(8):
        assert value(registry, "rdma_port_state", f"mlx5_{i}") == 4  # 4: ACTIVE
        assert value(registry, "rdma_port_physical_state", f"mlx5_{i}") == 5  # 5: LinkUp
        assert value(registry, "rdma_port_rate_bytes_per_second", f"mlx5_{i}") == 400e9 / 8  # 400 Gb/sec


def test_byte_counters_are_four_times_the_file_value():
    registry = scrape(SYSFS)
    assert value(registry, "rdma_port_transmit_bytes_total", "mlx5_3") == 4 * file_value(
        "mlx5_3", "counters/port_xmit_data"
    )
    assert value(registry, "rdma_port_receive_bytes_total", "mlx5_3") == 4 * file_value(
        "mlx5_3", "counters/port_rcv_data"
    )
    # packets are not words: taken as they are
    assert value(registry, "rdma_port_transmit_packets_total", "mlx5_3") == file_value(
        "mlx5_3", "counters/port_xmit_packets"
    )


def test_port_counters_of_the_issue_are_named_as_listed():
    registry = scrape(SYSFS)
    expected = {
        "rdma_port_transmit_wait_total": "port_xmit_wait",
        "rdma_port_receive_errors_total": "port_rcv_errors",
        "rdma_port_transmit_discards_total": "port_xmit_discards",
        "rdma_symbol_errors_total": "symbol_error",
        "rdma_link_downed_total": "link_downed",
        "rdma_link_error_recovery_total": "link_error_recovery",
        "rdma_port_receive_packets_total": "port_rcv_packets",
    }
    for name, file in expected.items():
        assert value(registry, name, "mlx5_3") == file_value("mlx5_3", f"counters/{file}"), name
    assert value(registry, "rdma_link_downed_total", "mlx5_3") == 2  # the flaky port of the fixture


def test_every_hw_counter_file_becomes_rdma_file_total():
    registry = scrape(SYSFS)
    files = sorted(p.name for p in (IB / "mlx5_3" / "ports" / "1" / "hw_counters").iterdir())
    assert len(files) >= 30 and "lifespan" in files
    for file in files:
        if file == "lifespan":  # the refresh period in ms: a setting, not a counter
            assert value(registry, "rdma_lifespan_total", "mlx5_3") is None
        else:
            assert value(registry, f"rdma_{file}_total", "mlx5_3") == file_value("mlx5_3", f"hw_counters/{file}"), file
    assert value(registry, "rdma_local_ack_timeout_err_total", "mlx5_3") == 131
    assert value(registry, "rdma_roce_adp_retrans_total", "mlx5_3") == 99
    assert value(registry, "rdma_np_cnp_sent_total", "mlx5_3") > 0
    assert value(registry, "rdma_out_of_sequence_total", "mlx5_3") == 52


def test_32_bit_queue_counters_keep_their_value_and_say_they_wrap():
    registry = scrape(SYSFS)
    assert value(registry, "rdma_rx_write_requests_total", "mlx5_5") == 4294967290
    family = next(f for f in registry.collect() if f.name == "rdma_rx_write_requests")
    assert "32-bit" in family.documentation and "wraps" in family.documentation


def test_64_bit_counters_beyond_float_precision_are_still_read(copied_sysfs):
    (copied_sysfs / "class/infiniband/mlx5_0/ports/1/counters/port_xmit_data").write_text("18446744073709551615\n")
    registry = scrape(copied_sysfs)
    assert value(registry, "rdma_port_transmit_bytes_total", "mlx5_0") == pytest.approx(4 * 18446744073709551615)


def test_no_pma_file_is_skipped_without_failing_the_port():
    registry = scrape(SYSFS)
    assert (IB / "mlx5_7/ports/1/counters/port_xmit_wait").read_text().strip() == "N/A (no PMA)"
    assert value(registry, "rdma_port_transmit_wait_total", "mlx5_7") is None
    assert value(registry, "rdma_port_transmit_bytes_total", "mlx5_7") == 4 * file_value(
        "mlx5_7", "counters/port_xmit_data"
    )
    assert value(registry, "rdma_port_transmit_wait_total", "mlx5_6") is not None


def test_missing_and_unreadable_files_are_skipped_without_failing_the_device(copied_sysfs):
    port = copied_sysfs / "class/infiniband/mlx5_2/ports/1"
    (port / "counters/port_rcv_data").unlink()
    (port / "rate").unlink()
    shutil.rmtree(port / "hw_counters")
    (copied_sysfs / "class/infiniband/mlx5_2/fw_ver").unlink()
    # a file the read of which fails (here EISDIR; EINVAL/EPERM on a real driver)
    (port / "counters/symbol_error").unlink()
    (port / "counters/symbol_error").mkdir()
    registry = scrape(copied_sysfs)
    assert registry.get_sample_value("stagetrace_collector_success", {"host": "node-a", "collector": "rdma"}) == 1
    assert value(registry, "rdma_port_receive_bytes_total", "mlx5_2") is None
    assert value(registry, "rdma_symbol_errors_total", "mlx5_2") is None
    assert value(registry, "rdma_port_rate_bytes_per_second", "mlx5_2") is None
    assert value(registry, "rdma_local_ack_timeout_err_total", "mlx5_2") is None
    assert value(registry, "rdma_port_transmit_bytes_total", "mlx5_2") == 4 * file_value(
        "mlx5_2", "counters/port_xmit_data"
    )
    info = {"netdev": "ens2f0np0", "link_layer": "Ethernet", "fw_ver": "", "hca_type": "MT4129", "rail": "mlx5_2/1"}
    assert value(registry, "rdma_port_info", "mlx5_2", **info) == 1


def test_info_names_netdev_link_layer_firmware_hca_type_and_rail():
    registry = scrape(SYSFS)
    info = {
        "netdev": "ens1f0np0",
        "link_layer": "Ethernet",
        "fw_ver": "28.39.2048",
        "hca_type": "MT4129",
        "rail": "mlx5_0/1",
    }
    assert value(registry, "rdma_port_info", "mlx5_0", **info) == 1


# --- rails ----------------------------------------------------------------------------------------------------


def rails_by_port(sysfs: Path, rails: str | None = None, env: dict | None = None) -> dict[tuple[str, str], str]:
    """{(device, port): rail} of rdma_port_info, the options built as the command line builds them."""
    argv = ["collect", "--once"] + (["--rdma-rails", rails] if rails is not None else [])
    options = Options.from_args(build_parser().parse_args(argv), environ=env or {})
    options.sysfs, options.host = sysfs, "node-a"
    families = Node([RdmaCollector(options)], "node-a").collect()
    return {
        (s.labels["device"], s.labels["port"]): s.labels["rail"]
        for f in families
        if f.name == "rdma_port"
        for s in f.samples
        if s.name == "rdma_port_info"
    }


@pytest.fixture
def three_ports(tmp_path) -> Path:
    """mlx5_0 with ports 1 and 2, and mlx5_1 with port 1."""
    ib = tmp_path / "sys" / "class" / "infiniband"
    for device in ("mlx5_0", "mlx5_1"):
        shutil.copytree(IB / device, ib / device)
    shutil.copytree(ib / "mlx5_0" / "ports" / "1", ib / "mlx5_0" / "ports" / "2")
    return tmp_path / "sys"


def test_by_default_every_port_is_a_rail_named_device_slash_port(three_ports):
    expected = {("mlx5_0", "1"): "mlx5_0/1", ("mlx5_0", "2"): "mlx5_0/2", ("mlx5_1", "1"): "mlx5_1/1"}
    assert rails_by_port(three_ports) == expected
    assert rails_by_port(three_ports, "") == expected  # an empty list is no list
    assert rails_by_port(SYSFS) == {(f"mlx5_{i}", "1"): f"mlx5_{i}/1" for i in range(8)}


def test_a_rail_list_names_its_ports_and_leaves_the_others_without_a_rail(three_ports, caplog):
    explicit = {("mlx5_0", "1"): "", ("mlx5_0", "2"): "rail0", ("mlx5_1", "1"): "mlx5_1/1"}
    with caplog.at_level(logging.WARNING, logger="stagetrace.collectors"):
        assert rails_by_port(three_ports, "rail0=mlx5_0:2, mlx5_1") == explicit
        assert rails_by_port(three_ports, env={"STAGETRACE_RDMA_RAILS": "rail0=mlx5_0:2,mlx5_1:1"}) == explicit
        # the flag wins over the variable
        assert rails_by_port(three_ports, "r=mlx5_0", env={"STAGETRACE_RDMA_RAILS": "rail0=mlx5_0:2"}) == {
            ("mlx5_0", "1"): "r",
            ("mlx5_0", "2"): "",
            ("mlx5_1", "1"): "",
        }
    assert not caplog.records
    assert Options(rails=parse_rails("a=mlx5_1")).rails == (("a", "mlx5_1", "1"),)


def test_a_listed_port_that_is_not_there_is_logged_once(three_ports, caplog):
    collector = RdmaCollector(Options(sysfs=three_ports, host="node-a", rails=parse_rails("r0=mlx5_0,r1=mlx5-1")))
    registry = scrape(three_ports, Node([collector], "node-a"))
    with caplog.at_level(logging.WARNING, logger="stagetrace.collectors"):
        for _ in range(3):
            assert registry.get_sample_value("stagetrace_collector_success", {"collector": "rdma", "host": "node-a"})
    assert caplog.messages == [f"rdma: rails name ports that are not under {three_ports}/class/infiniband: r1=mlx5-1:1"]


MALFORMED = {
    "=mlx5_0": "rail entry '=mlx5_0' has no rail name before '='",
    "a=": "rail entry 'a=' names no RDMA device",
    "a=:1": "rail entry 'a=:1' names no RDMA device",
    "a=b=mlx5_0": "rail entry 'a=b=mlx5_0' has more than one '='",
    "a=mlx5/0": "rail entry 'a=mlx5/0': 'mlx5/0' is not a device name as in /sys/class/infiniband",
    "mlx5_0:x": "rail entry 'mlx5_0:x': port 'x' is not a port number",
    "a=mlx5_0:": "rail entry 'a=mlx5_0:': port '' is not a port number",
    "mlx5_0:0": "rail entry 'mlx5_0:0': port '0' is not a port number",
    "a=mlx5_0,b=mlx5_0:1": "port mlx5_0:1 is listed in two rails, 'a' and 'b': a port belongs to one rail",
    "mlx5_0,mlx5_0:1": "port mlx5_0:1 is listed twice",
    "a=mlx5_0,a=mlx5_1": "rail 'a' has two ports, mlx5_0:1 and mlx5_1:1: a host has one port per rail",
    "mlx5_1/1=mlx5_0,mlx5_1": "rail 'mlx5_1/1' has two ports, mlx5_0:1 and mlx5_1:1",
}


@pytest.mark.parametrize("text", MALFORMED)
def test_a_malformed_rail_list_is_refused_at_parse_time_naming_the_flag_or_the_variable(text):
    args = build_parser().parse_args(["collect", "--once", "--rdma-rails", text])
    with pytest.raises(ValueError) as flag:
        Options.from_args(args, environ={})
    assert str(flag.value).startswith(f"--rdma-rails: {MALFORMED[text]}") and "\n" not in str(flag.value)
    with pytest.raises(ValueError) as variable:
        Options.from_args(build_parser().parse_args(["collect", "--once"]), environ={"STAGETRACE_RDMA_RAILS": text})
    assert str(variable.value).startswith(f"STAGETRACE_RDMA_RAILS: {MALFORMED[text]}")


def test_collect_with_a_malformed_rail_list_prints_one_line_and_exits_2(tmp_path):
    env = {**os.environ, "STAGETRACE_RDMA_RAILS": ""}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "stagetrace",
            "collect",
            "--once",
            "--sysfs",
            str(SYSFS),
            "--collectors",
            "rdma",
            "--rdma-rails",
            "=mlx5_0",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        "stagetrace: --rdma-rails: rail entry '=mlx5_0' has no rail name before '=': "
        "write NAME=DEVICE[:PORT] or DEVICE[:PORT], comma-separated, e.g. rail0=mlx5_0,rail1=mlx5_1:1\n"
    )


def test_rdma_netdevs_maps_roce_ports_and_skips_infiniband_ones(copied_sysfs):
    assert rdma_netdevs(SYSFS) == {(f"mlx5_{i}", "1"): f"ens{i // 2 + 1}f{i % 2}np{i % 2}" for i in range(8)}
    port = copied_sysfs / "class/infiniband/mlx5_1/ports/1"
    (port / "link_layer").write_text("InfiniBand\n")
    (port / "rate").write_text("2.5 Gb/sec (1X SDR)\n")
    assert ("mlx5_1", "1") not in rdma_netdevs(copied_sysfs)
    assert rdma_netdevs(copied_sysfs / "nowhere") == {}
    registry = scrape(copied_sysfs)
    assert value(registry, "rdma_port_rate_bytes_per_second", "mlx5_1") == 312_500_000  # procfs's own test value


def test_absent_infiniband_class_reports_success_0_and_logs_once(tmp_path, caplog):
    node = Node([RdmaCollector(Options(sysfs=tmp_path, host="node-a"))], "node-a")
    registry = scrape(tmp_path, node)
    with caplog.at_level(logging.INFO, logger="stagetrace.collectors"):
        for _ in range(3):
            assert (
                registry.get_sample_value("stagetrace_collector_success", {"host": "node-a", "collector": "rdma"}) == 0
            )
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warnings == [
            f"collector rdma: {tmp_path}/class/infiniband does not exist: "
            "no RDMA device or driver on this host (--sysfs sets the sysfs root)"
        ]
        shutil.copytree(SYSFS, tmp_path, dirs_exist_ok=True)  # the driver is loaded: the source comes back
        assert registry.get_sample_value("stagetrace_collector_success", {"host": "node-a", "collector": "rdma"}) == 1
        assert "collector rdma: source is back" in caplog.messages


# --- files held open between scrapes (collectors.sysfs) ------------------------------------------------------


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_one_collector_reads_each_scrape_anew_as_files_change_appear_and_go(copied_sysfs):
    """One collector over many scrapes, as the agent runs it: values rewritten in place, a counter file added, one
    removed, one replaced by rename, and a whole device gone and back, each seen at the next scrape."""
    registry = scrape(copied_sysfs)
    port = copied_sysfs / "class/infiniband/mlx5_1/ports/1"
    assert value(registry, "rdma_port_transmit_packets_total", "mlx5_1") == file_value(
        "mlx5_1", "counters/port_xmit_packets"
    )
    (port / "counters/port_xmit_packets").write_text("123456789\n")  # in place, as the kernel's counters change
    assert value(registry, "rdma_port_transmit_packets_total", "mlx5_1") == 123456789
    (port / "hw_counters/req_cqe_error").unlink()
    (port / "hw_counters/new_driver_counter").write_text("77\n")
    tmp = port / "counters/.port_rcv_packets"
    tmp.write_text("42\n")
    tmp.replace(port / "counters/port_rcv_packets")  # a new inode under the old name
    assert value(registry, "rdma_req_cqe_error_total", "mlx5_1") is None
    assert value(registry, "rdma_new_driver_counter_total", "mlx5_1") == 77
    assert value(registry, "rdma_port_receive_packets_total", "mlx5_1") == 42
    device = copied_sysfs / "class/infiniband/mlx5_5"
    shutil.move(device, copied_sysfs / "mlx5_5.unloaded")
    assert value(registry, "rdma_port_state", "mlx5_5") is None
    shutil.move(copied_sysfs / "mlx5_5.unloaded", device)
    assert value(registry, "rdma_port_state", "mlx5_5") == 4


def test_held_descriptors_stay_level_over_scrapes_and_are_released_when_ports_go_and_on_close(copied_sysfs):
    gc.collect()  # earlier tests' collectors let their files go when collected
    before = _open_descriptors()
    collector = RdmaCollector(Options(sysfs=copied_sysfs, host="node-a"))
    registry = scrape(copied_sysfs, Node([collector], "node-a"))
    for _ in range(2):  # the second holds the file of each port's netdev, which the first found
        assert value(registry, "rdma_port_state", "mlx5_0") == 4
    held = _open_descriptors() - before
    files_per_port = sum(1 for f in (IB / "mlx5_0/ports/1").glob("*counters/*"))
    assert held >= 8 * files_per_port  # every counter of the 8 ports is held...
    for _ in range(20):
        registry.get_sample_value("rdma_port_state", {"host": "node-a", "device": "mlx5_0", "port": "1"})
    assert _open_descriptors() - before == held  # ...and no scrape opens more
    shutil.rmtree(copied_sysfs / "class/infiniband/mlx5_7")
    assert value(registry, "rdma_port_state", "mlx5_0") == 4
    assert _open_descriptors() - before < held  # the gone device's files are let go
    collector.close()
    assert _open_descriptors() == before


def test_with_few_descriptors_to_spare_files_are_read_without_holding_them(tmp_path):
    """A process whose open-file limit (hard, so it cannot be raised) leaves no room to hold 472 files reads them
    with open, read and close: the same samples."""
    script = tmp_path / "few.py"
    script.write_text(f"""
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))
from pathlib import Path
from stagetrace.collectors.base import Node, Options
from stagetrace.collectors.rdma import RdmaCollector
from stagetrace.exporters.prometheus import exposition
node = Node([RdmaCollector(Options(sysfs=Path({str(SYSFS)!r}), host="node-a"))], "node-a")
for _ in range(3):
    text = exposition(list(node.collect())).decode()
sys.stdout.write(text)
""")
    few = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True).stdout
    plenty = exposition(list(Node([RdmaCollector(Options(sysfs=SYSFS, host="node-a"))], "node-a").collect())).decode()

    def without_durations(text):
        return [line for line in text.splitlines() if "duration_seconds" not in line]

    assert without_durations(few) == without_durations(plenty)
    assert "rdma_local_ack_timeout_err_total" in few


def test_a_held_real_sysfs_attribute_reads_its_new_value(tmp_path):
    """The kernel behaviour the held files rest on, on a real sysfs attribute: the loopback interface's
    ``rx_packets``, held open, reads the packets sent since, with no reopen."""
    from stagetrace.collectors.sysfs import HeldFiles

    statistics = "/sys/class/net/lo/statistics"
    if not os.path.exists(f"{statistics}/rx_packets"):
        pytest.skip("no /sys/class/net/lo here")
    files = HeldFiles()
    try:
        first = int(files.read(statistics, ("rx_packets",))["rx_packets"])
        with (
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as receiver,
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender,
        ):
            receiver.bind(("127.0.0.1", 0))
            for _ in range(50):
                sender.sendto(b"x", receiver.getsockname())
        second = int(files.read(statistics, ("rx_packets",))["rx_packets"])
    finally:
        files.close()
    assert second >= first + 50


# --- conformance with Debian's prometheus-node-exporter on the same tree ---------------------------------------

# node_infiniband_<name> -> ours. hw counters are listed for node_exporter >= 1.6 (Debian 12 ships 1.5.0,
# whose procfs does not read hw_counters yet: there, only the unit tests above check them).
NODE_EXPORTER_NAMES = {
    "port_data_transmitted_bytes_total": "rdma_port_transmit_bytes_total",
    "port_data_received_bytes_total": "rdma_port_receive_bytes_total",
    "port_packets_transmitted_total": "rdma_port_transmit_packets_total",
    "port_packets_received_total": "rdma_port_receive_packets_total",
    "unicast_packets_transmitted_total": "rdma_port_unicast_transmit_packets_total",
    "unicast_packets_received_total": "rdma_port_unicast_receive_packets_total",
    "multicast_packets_transmitted_total": "rdma_port_multicast_transmit_packets_total",
    "multicast_packets_received_total": "rdma_port_multicast_receive_packets_total",
    "port_transmit_wait_total": "rdma_port_transmit_wait_total",
    "port_errors_received_total": "rdma_port_receive_errors_total",
    "port_discards_transmitted_total": "rdma_port_transmit_discards_total",
    "port_receive_remote_physical_errors_total": "rdma_port_receive_remote_physical_errors_total",
    "port_receive_switch_relay_errors_total": "rdma_port_receive_switch_relay_errors_total",
    "port_constraint_errors_transmitted_total": "rdma_port_transmit_constraint_errors_total",
    "port_constraint_errors_received_total": "rdma_port_receive_constraint_errors_total",
    "symbol_error_total": "rdma_symbol_errors_total",
    "link_downed_total": "rdma_link_downed_total",
    "link_error_recovery_total": "rdma_link_error_recovery_total",
    "local_link_integrity_errors_total": "rdma_local_link_integrity_errors_total",
    "excessive_buffer_overrun_errors_total": "rdma_excessive_buffer_overrun_errors_total",
    "vl15_dropped_total": "rdma_vl15_dropped_total",
    "rate_bytes_per_second": "rdma_port_rate_bytes_per_second",
    "state_id": "rdma_port_state",
    "physical_state_id": "rdma_port_physical_state",
    "duplicate_requests_packets_total": "rdma_duplicate_request_total",
    "implied_nak_seq_errors_total": "rdma_implied_nak_seq_err_total",
    "local_ack_timeout_errors_total": "rdma_local_ack_timeout_err_total",
    "np_cnp_packets_sent_total": "rdma_np_cnp_sent_total",
    "np_ecn_marked_roce_packets_received_total": "rdma_np_ecn_marked_roce_packets_total",
    "out_of_buffer_drops_total": "rdma_out_of_buffer_total",
    "out_of_sequence_packets_received_total": "rdma_out_of_sequence_total",
    "packet_sequence_errors_total": "rdma_packet_seq_err_total",
    "req_cqes_errors_total": "rdma_req_cqe_error_total",
    "req_cqes_flush_errors_total": "rdma_req_cqe_flush_error_total",
    "req_remote_access_errors_total": "rdma_req_remote_access_errors_total",
    "req_remote_invalid_request_errors_total": "rdma_req_remote_invalid_request_total",
    "resp_cqes_errors_total": "rdma_resp_cqe_error_total",
    "resp_cqes_flush_errors_total": "rdma_resp_cqe_flush_error_total",
    "resp_local_length_errors_total": "rdma_resp_local_length_error_total",
    "resp_remote_access_errors_total": "rdma_resp_remote_access_errors_total",
    "rnr_nak_retry_packets_received_total": "rdma_rnr_nak_retry_err_total",
    "roce_adp_retransmits_total": "rdma_roce_adp_retrans_total",
    "roce_adp_retransmits_timeout_total": "rdma_roce_adp_retrans_to_total",
    "roce_slow_restart_used_total": "rdma_roce_slow_restart_total",  # node_exporter's names for the three
    "roce_slow_restart_cnps_total": "rdma_roce_slow_restart_cnps_total",  # slow-restart counters are shuffled
    "roce_slow_restart_total": "rdma_roce_slow_restart_trans_total",
    "rp_cnp_packets_handled_total": "rdma_rp_cnp_handled_total",
    "rp_cnp_ignored_packets_received_total": "rdma_rp_cnp_ignored_total",
    "rx_atomic_requests_total": "rdma_rx_atomic_requests_total",
    "rx_dct_connect_requests_total": "rdma_rx_dct_connect_total",
    "rx_read_requests_total": "rdma_rx_read_requests_total",
    "rx_write_requests_total": "rdma_rx_write_requests_total",
    "rx_icrc_encapsulated_errors_total": "rdma_rx_icrc_encapsulated_total",
}
# Not values of ours: the hw_counters refresh setting (ms / 1000, integer division in node_exporter).
NOT_COMPARED = {"lifespan_seconds"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fetch_when_up(url: str, process: subprocess.Popen, timeout: float = 15.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.read().decode()
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{url} never answered: {process.args[0]} exited {process.poll()}") from None
            time.sleep(0.1)


@pytest.fixture
def node_exporter_samples(component, tmp_path):
    """node_exporter's infiniband samples over the fixture tree: {(name, device, port): value}, and its info labels."""
    binary = component("prometheus-node-exporter", package="prometheus-node-exporter")
    address = f"127.0.0.1:{free_port()}"
    log = open(tmp_path / "node_exporter.log", "w")
    process = subprocess.Popen(
        [
            binary,
            f"--path.sysfs={SYSFS}",
            "--collector.disable-defaults",
            "--collector.infiniband",
            f"--web.listen-address={address}",
        ],
        stdout=log,
        stderr=log,
    )
    try:
        text = fetch_when_up(f"http://{address}/metrics", process)
    finally:
        process.terminate()
        process.wait(timeout=10)
        log.close()
    samples, info = {}, {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "node_scrape_collector_success":
                assert s.value == 1, (tmp_path / "node_exporter.log").read_text()
            elif s.name == "node_infiniband_info":
                info[s.labels["device"]] = s.labels
            elif s.name.startswith("node_infiniband_"):
                samples[(s.name.removeprefix("node_infiniband_"), s.labels["device"], s.labels["port"])] = s.value
    return samples, info


def test_every_value_node_exporter_exports_is_ours(node_exporter_samples):
    theirs, their_info = node_exporter_samples
    ours = scrape(SYSFS)
    unmapped = {name for name, _, _ in theirs} - NODE_EXPORTER_NAMES.keys() - NOT_COMPARED
    assert not unmapped, f"node_exporter exports RDMA metrics the test does not map: {sorted(unmapped)}"
    compared = 0
    for (name, device, port), their_value in sorted(theirs.items()):
        if name in NOT_COMPARED:
            continue
        assert value(ours, NODE_EXPORTER_NAMES[name], device, port) == their_value, (name, device, port)
        compared += 1
    # every PMA counter on 8 ports (less mlx5_7's N/A one) plus rate and both states
    assert compared >= 8 * (len(PORT_COUNTERS) + 3) - 1
    assert ("port_transmit_wait_total", "mlx5_7", "1") not in theirs  # both skip the N/A (no PMA) file
    for device, labels in their_info.items():
        info = {
            "netdev": rdma_netdevs(SYSFS)[(device, "1")],
            "link_layer": "Ethernet",
            "rail": f"{device}/1",
            "fw_ver": labels["firmware_version"],
            "hca_type": labels["hca_type"],
        }
        assert value(ours, "rdma_port_info", device, **info) == 1
    assert len(their_info) == 8
