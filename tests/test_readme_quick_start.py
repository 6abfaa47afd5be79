"""The README's Quick start, pasted as a newcomer would: in a scratch copy of this checkout, with a home of its own
and nothing on the PATH but the system's, its first block (a fresh virtual environment, ``pip install .``, the demo)
and then the commands of "Then, on your own pipeline" with the environment activated as it says. A real install:
whatever the package forgets to declare fails here, not on a newcomer's machine.

``stagetrace agent`` is the one command left out: it serves until stopped (``tests/test_agent.py`` runs it).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
LEFT_OUT = ("stagetrace agent",)


def _blocks(section: str) -> list[str]:
    body = README.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)```", body, flags=re.S)


def _commands(block: str) -> list[str]:
    """The block's command lines, each without its comment."""
    return [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip() and not line.startswith(" ")]


def test_the_quick_start_works_when_pasted_into_a_fresh_checkout(tmp_path):
    checkout = tmp_path / "stagetrace"
    shutil.copytree(
        ROOT,
        checkout,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "*.egg-info", "__pycache__", "build", "site", "test-artifacts", ".pytest_cache"
        ),
    )
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "COLUMNS": "200", "LANG": "C.UTF-8"}
    (first,) = _commands(_blocks("Quick start")[0])
    done = subprocess.run(["bash", "-c", first], cwd=checkout, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (home / ".local" / "share" / "stagetrace" / "store").is_dir()  # the default embedded store
    request_id = re.search(r"stagetrace explain (req-[0-9a-f]+)", done.stdout)[1]

    then = _commands(_blocks("Then, on your own pipeline")[0])
    assert then[0] == "source .venv/bin/activate"
    ran = []
    for command in then[1:]:
        if command.startswith(LEFT_OUT):
            continue
        pasted = subprocess.run(
            ["bash", "-c", f"source .venv/bin/activate && {command.replace('REQUEST_ID', request_id)}"],
            cwd=checkout,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert pasted.returncode == 0, f"{command}: {pasted.stderr[-2000:]}"
        ran.append(command.split()[1])
    assert ran == ["trace", "explain", "divergences", "provision"]
    # the folder the README and docs/grafana.md name, outside the checkout (a file written into the checkout shows
    # in `git status` and travels with the next copy of it)
    assert (home / "grafana-provisioning" / "dashboards").is_dir()
    assert not (checkout / "provisioning").exists()
