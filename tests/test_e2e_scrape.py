"""End-to-end scrape of the committed fixture node, diffed against a committed expected file (node_exporter's e2e test).

The fixture node has 8 GPUs (NVML snapshots recorded in NVML's own shapes: no GPU exists here), MPS
control answers, 8 RDMA ports as a sysfs tree, 4 dual-port NICs' ethtool statistics, NCCL
Inspector dumps, a kubelet serving its pods' PodResources over gRPC on a unix socket (the
answers under tests/fixtures/kubelet/h200-node), and the host's /proc and /var/log as far as they name the GPU
processes' pods. ``stagetrace collect --once`` runs as a real process over them; the series that
cannot be deterministic (scrape durations, dump ages) are dropped before the diff. A change to a
name, a help text or a label shows up here as a diff. Regenerate with
``STAGETRACE_UPDATE_GOLDEN=1 bash scripts/test tests/test_e2e_scrape.py``.
"""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
import sys
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures" / "node"
KUBELET = Path(__file__).parent / "fixtures" / "kubelet" / "h200-node"
EXPECTED = FIXTURES / "expected.prom"
NONDETERMINISTIC = ("stagetrace_collector_duration_seconds", "nccl_inspector_dump_age_seconds")


def scrape(tmp_path: Path, kubelet_socket: Path) -> str:
    # NCCL dumps older than five minutes are stale by design: copies with a fresh mtime (not copy2's old one).
    nccl = shutil.copytree(FIXTURES / "nccl", tmp_path / "nccl", copy_function=shutil.copy)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "stagetrace",
            "collect",
            "--once",
            "--collectors",
            "gpu,mps,rdma,ethtool,nccl,kubernetes",
            "--sysfs",
            str(FIXTURES / "sys"),
            "--nvml-fixture",
            str(FIXTURES / "nvml"),
            "--mps-fixture",
            str(FIXTURES / "mps"),
            "--ethtool-fixture",
            str(FIXTURES / "ethtool" / "statistics.json"),
            "--nccl-dir",
            str(nccl),
            "--kubelet-socket",
            str(kubelet_socket),
            "--procfs",
            str(FIXTURES / "proc"),
            "--kubelet-log-dir",
            str(FIXTURES / "log"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "STAGETRACE_HOST": "fixture-node"},
    )
    assert done.returncode == 0, done.stderr
    assert "stagetrace:" not in done.stderr, done.stderr  # no GPU of this node is shared or counted twice
    return "".join(
        line + "\n" for line in done.stdout.splitlines() if not line.split("{")[0].split(" ")[0] in NONDETERMINISTIC
    )


def test_fixture_node_scrape_matches_expected(tmp_path, kubelet):
    scraped = scrape(tmp_path, kubelet(KUBELET))
    if os.environ.get("STAGETRACE_UPDATE_GOLDEN") == "1":
        EXPECTED.write_text(scraped)
    diff = "".join(
        difflib.unified_diff(
            EXPECTED.read_text().splitlines(True), scraped.splitlines(True), "expected.prom", "scraped"
        )
    )
    assert not diff, diff
    assert 'stagetrace_collector_success{collector="nccl",host="fixture-node"} 1.0' in scraped
    assert 'stagetrace_collector_success{collector="gpu",host="fixture-node"} 1.0' in scraped
    assert 'stagetrace_collector_success{collector="kubernetes",host="fixture-node"} 1.0' in scraped


def test_expected_scrape_passes_promtool_check_metrics(component):
    promtool = component("promtool", package="prometheus")
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=EXPECTED.read_text(), capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
