"""The docs: the README is a short front page whose first two commands set everything up, every page of docs/ is
one click from it, and the pages build as a site with MkDocs in strict mode (no broken page, link or anchor)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"


def home_page(readme: str) -> str:
    """docs/index.md is the README with its links made relative to docs/ (so the two cannot drift)."""
    return readme.replace("](docs/", "](").replace("[Deploy](deploy/README.md)", "Deploy (`deploy/README.md`)")


def test_the_readme_is_a_front_page_whose_first_two_commands_set_everything_up():
    assert README.count("\n") <= 200
    blocks = re.findall(r"```sh\n(.*?)```", README, flags=re.S)
    assert "pip install -q . && .venv/bin/stagetrace demo" in blocks[0]
    assert blocks[1].strip() == "bash scripts/test"
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("bash scripts/test")


def test_every_page_is_one_click_from_the_readme_and_in_the_sites_navigation():
    pages = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    linked = set(re.findall(r"\]\(docs/([a-z0-9-]+\.md)\)", README))
    assert pages == linked
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def listed(entries) -> set[str]:
        out = set()
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            out |= listed(value) if isinstance(value, list) else {value}
        return out

    assert listed(config["nav"]) == pages | {"index.md"}
    assert (DOCS / "index.md").read_text() == home_page(README), "docs/index.md: write it from the README again"


def test_the_site_builds_with_every_link_and_anchor_resolved(tmp_path):
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                           cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # fmt: skip
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "site" / "explain" / "index.html").exists()
