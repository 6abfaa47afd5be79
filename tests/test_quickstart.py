"""The README's first command: the quickstart pipeline into the embedded default store, then a lookup."""

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_records_requests_that_trace_finds(tmp_path):
    # run with the venv's Python, the venv not activated: stagetrace is not on PATH
    env = {"XDG_DATA_HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, ROOT / "examples" / "quickstart.py"], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert "stagetrace trace quickstart-0001" in run.stdout
    # the command it prints works pasted as it is, in that shell
    (printed,) = [line.split("look one up:", 1)[1].strip() for line in run.stdout.splitlines() if "look one up" in line]
    pasted = subprocess.run(["sh", "-c", printed + " --json"], capture_output=True, text=True, env=env, timeout=60)
    assert pasted.returncode == 0 and json.loads(pasted.stdout)["request_id"] == "quickstart-0001", (printed, pasted)
    assert (tmp_path / "stagetrace" / "store").is_dir()  # the default embedded store
    looked_up = subprocess.run(
        [sys.executable, "-m", "stagetrace", "trace", "quickstart-0001", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert looked_up.returncode == 0, looked_up.stderr
    doc = json.loads(looked_up.stdout)
    stages = [s["stage"] for s in doc["spans"]]
    assert stages == [None, "retrieval", "cache", "context_assembly", "allreduce", "allreduce", "decode"]


def test_the_example_says_how_to_run_it_without_an_active_venv():
    """A fresh clone's shell has no ``python`` with stagetrace on it: the docstring's commands name the venv's, as the
    recording page does."""
    example = ast.get_docstring(ast.parse((ROOT / "examples" / "quickstart.py").read_text()))
    (line,) = [ln.strip() for ln in example.splitlines() if "examples/quickstart.py" in ln]
    run, _, then = line.partition("# then:")
    recording = (ROOT / "docs" / "recording.md").read_text()
    for command in (run.strip(), then.strip()):
        assert command.startswith(".venv/bin/"), command
        assert f"`{command}`" in recording, command
