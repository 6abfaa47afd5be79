"""The README's first command: the quickstart pipeline into the embedded default store, then a lookup."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_records_requests_that_trace_finds(tmp_path):
    env = {"XDG_DATA_HOME": str(tmp_path), "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin",
           "HOME": str(tmp_path)}  # fmt: skip
    run = subprocess.run([sys.executable, ROOT / "examples" / "quickstart.py"], capture_output=True, text=True,
                         env=env, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "stagetrace trace quickstart-0001" in run.stdout
    assert (tmp_path / "stagetrace" / "store").is_dir()  # the default embedded store
    looked_up = subprocess.run([sys.executable, "-m", "stagetrace", "trace", "quickstart-0001", "--json"],
                               capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    assert looked_up.returncode == 0, looked_up.stderr
    doc = json.loads(looked_up.stdout)
    stages = [s["stage"] for s in doc["spans"]]
    assert stages == [None, "retrieval", "cache", "context_assembly", "allreduce", "allreduce", "decode"]
