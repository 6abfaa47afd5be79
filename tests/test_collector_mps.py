"""The mps collector, with recorded nvidia-cuda-mps-control answers and NVML snapshots.

No GPU or MPS daemon exists where these tests run: the control answers under tests/fixtures/node/mps
are what the daemon prints for each command, the NVML snapshots are in NVML's own shapes (see
test_collector_gpu). The binary path is exercised with small stand-in executables written per test
(one that answers, one that hangs), run exactly as the real binary would be.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
from stagetrace.collectors import build_node
from stagetrace.collectors.base import Node, Options
from stagetrace.collectors.mps import BinaryControl, MpsCollector, write_mps_fixture
from tests.samples import scrape, series, value

FIXTURES = Path(__file__).parent / "fixtures" / "node"
ONE_GPU = "one-gpu-two-clients"


def test_one_gpu_shared_by_two_mps_clients_is_one_device_with_two_clients():
    """The node a scheduler reports as `used: 2, capacity: 1`: one physical GPU, two MPS clients."""
    options = Options(host="n1", nvml_fixture=FIXTURES / "nvml" / ONE_GPU, mps_fixture=FIXTURES / "mps" / ONE_GPU)
    result = scrape(build_node("gpu,mps", options))

    devices = series(result, "gpu_up")
    assert [v for _, v in devices] == [1]  # capacity: 1 device
    uuid = devices[0][0]["uuid"]
    assert [(lbl["uuid"], v) for lbl, v in series(result, "mps_clients")] == [(uuid, 2)]  # counted once, 2 clients
    clients = series(result, "mps_client_memory_used_bytes")
    assert sorted(lbl["pid"] for lbl, _ in clients) == ["3201", "3202"] and {lbl["uuid"] for lbl, _ in clients} == {
        uuid
    }
    assert value(result, "mps_server_clients", pid=3110) == 2
    assert value(result, "mps_daemon_up") == 1


def test_fixture_node_daemon_servers_and_clients():
    options = Options(nvml_fixture=FIXTURES / "nvml", mps_fixture=FIXTURES / "mps")
    result = scrape(Node([MpsCollector(options)], host="n1"))

    assert value(result, "mps_daemon_up") == 1
    assert value(result, "mps_servers") == 1
    assert value(result, "mps_default_active_thread_percentage") == 50
    assert value(result, "mps_clients", gpu=0) == 2
    assert sum(v for _, v in series(result, "mps_clients")) == 2 and len(series(result, "mps_clients")) == 8
    assert value(result, "mps_client_memory_used_bytes", gpu=0, pid=5101) == 41 * 2**30
    assert value(result, "mps_client_sm_utilization_ratio", gpu=0, pid=5101) == pytest.approx(
        0.61
    )  # mean of 58 and 64 %
    assert value(result, "mps_client_sm_utilization_ratio", gpu=0, pid=5102) == pytest.approx(0.33)


def test_no_daemon_is_mps_daemon_up_0_not_a_failure(tmp_path, caplog):
    write_mps_fixture(tmp_path, {})  # the daemon answers nothing
    node = Node([MpsCollector(Options(nvml_fixture=FIXTURES / "nvml", mps_fixture=tmp_path))], host="n1")
    for _ in range(2):
        result = scrape(node)
    assert value(result, "mps_daemon_up") == 0
    assert value(result, "stagetrace_collector_success", collector="mps") == 1
    assert series(result, "mps_servers") == []
    assert value(result, "mps_clients", gpu=0) == 2  # NVML still sees them: a pipe-directory mismatch shows
    assert len([r for r in caplog.records if "mps_daemon_up 0" in r.getMessage()]) == 1


def _fake_binary(bin_dir: Path, body: str) -> None:
    bin_dir.mkdir()
    script = bin_dir / "nvidia-cuda-mps-control"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)


@pytest.fixture
def pipe_dir(tmp_path) -> Path:
    pipe = tmp_path / "nvidia-mps"
    pipe.mkdir()
    os.mkfifo(pipe / "control")
    return pipe


def test_control_binary_is_asked_with_the_pipe_directory(tmp_path, pipe_dir, monkeypatch):
    _fake_binary(
        tmp_path / "bin",
        f"""
[ "$CUDA_MPS_PIPE_DIRECTORY" = "{pipe_dir}" ] || {{ echo "wrong pipe directory" >&2; exit 1; }}
read command
case "$command" in
  get_server_list) echo 77 ;;
  "get_client_list 77") printf '81\\n82\\n83\\n' ;;
  get_default_active_thread_percentage) echo 25.0 ;;
  *) exit 1 ;;
esac
""",
    )
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    options = Options(nvml_fixture=FIXTURES / "nvml" / ONE_GPU, mps_pipe_dir=pipe_dir, mps_fixture=None)
    result = scrape(Node([MpsCollector(options)], host="n1"))
    assert value(result, "mps_daemon_up") == 1
    assert value(result, "mps_server_clients", pid=77) == 3
    assert value(result, "mps_default_active_thread_percentage") == 25


def test_a_hanging_control_binary_does_not_hang_the_scrape(tmp_path, pipe_dir, monkeypatch, caplog):
    _fake_binary(tmp_path / "bin", "sleep 30\n")
    monkeypatch.setenv("PATH", str(tmp_path / "bin") + os.pathsep + os.environ["PATH"])
    options = Options(nvml_fixture=FIXTURES / "nvml" / ONE_GPU, mps_fixture=None)
    collector = MpsCollector(options, control=BinaryControl(pipe_dir, timeout=0.5))

    started = time.monotonic()
    result = scrape(Node([collector], host="n1"))
    assert time.monotonic() - started < 5
    assert value(result, "mps_daemon_up") == 0
    assert value(result, "stagetrace_collector_success", collector="mps") == 1
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == [
        "mps: nvidia-cuda-mps-control did not answer `get_server_list` within 0.5s; mps_daemon_up 0"
    ]


def test_control_binary_without_a_control_pipe_means_no_daemon(tmp_path, monkeypatch):
    ran = tmp_path / "ran"
    _fake_binary(tmp_path / "bin", f"touch {ran}\n")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    options = Options(nvml_fixture=FIXTURES / "nvml" / ONE_GPU, mps_pipe_dir=tmp_path / "nvidia-mps", mps_fixture=None)
    result = scrape(Node([MpsCollector(options)], host="n1"))
    assert value(result, "mps_daemon_up") == 0
    assert not ran.exists()  # nothing to ask without the daemon's pipe


def test_no_binary_and_no_pipe_directory_is_not_an_mps_host(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))
    options = Options(nvml_fixture=FIXTURES / "nvml" / ONE_GPU, mps_pipe_dir=tmp_path / "nvidia-mps", mps_fixture=None)
    node = Node([MpsCollector(options)], host="n1")
    for _ in range(2):
        result = scrape(node)
        assert value(result, "stagetrace_collector_success", collector="mps") == 0
    pipe_dir = tmp_path / "nvidia-mps"
    assert [r.getMessage() for r in caplog.records] == [
        f"collector mps: no CUDA MPS here: nvidia-cuda-mps-control is not on PATH and {pipe_dir} does not exist"
    ]
