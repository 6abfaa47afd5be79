"""The docs: the README is a short front page whose first two commands set everything up, every page of docs/ is
one click from it, and the pages build as a site with Zensical in strict mode (no broken page, link or anchor)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
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


def _build(where: Path, appended: str = "") -> subprocess.CompletedProcess:
    """Zensical's strict build of a copy of docs/ and mkdocs.yml under ``where`` (it builds into the project's folder:
    the checkout's ``site/`` is left alone), ``appended`` added to the home page."""
    shutil.copytree(DOCS, where / "docs")
    shutil.copy(ROOT / "mkdocs.yml", where / "mkdocs.yml")
    if appended:
        (where / "docs" / "index.md").write_text((where / "docs" / "index.md").read_text() + f"\n{appended}\n")
    return subprocess.run(
        [Path(sys.executable).with_name("zensical"), "build", "--strict"],
        cwd=where,
        capture_output=True,
        text=True,
        timeout=300,
    )


def build_site(where: Path) -> Path:
    """The site built in strict mode (see ``_build``): its folder."""
    built = _build(where)
    assert built.returncode == 0, built.stdout + built.stderr
    return where / "site"


def test_the_site_builds_with_every_link_and_anchor_resolved(tmp_path):
    site = build_site(tmp_path)
    assert (site / "explain" / "index.html").exists()
    assert 'href="../stylesheets/extra.css"' in (site / "explain" / "index.html").read_text()


def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
    """Strict mode is what catches a link to a page or a heading that is not there (the test above relies on it)."""
    for n, broken in enumerate(("[gone](no-such-page.md)", "[gone](agent.md#no-such-heading)")):
        built = _build(tmp_path / str(n), broken)
        assert built.returncode != 0 and "does not exist" in built.stdout + built.stderr, (broken, built.stdout)


# A pointer from the code to the docs: a page of docs/, and maybe a heading on it.
POINTER = re.compile(r"docs/([a-z0-9-]+\.md)(?:#([a-z0-9-]+))?")
CODE = [
    p
    for folder in ("src", "collectors", "exporters", "dashboards", "tests", "benchmarks")
    for p in sorted((ROOT / folder).rglob("*.py"))
    if p.name != "test_docs.py"
]


def _anchors(page: Path) -> set[str]:
    """The ids MkDocs gives a page's headings (the toc extension's slugs), code blocks left out."""
    from markdown.extensions.toc import slugify

    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {slugify(heading, "-") for heading in re.findall(r"^#{1,6} (.+?)\s*$", text, flags=re.M)}


def test_what_the_codes_comments_cite_is_in_the_repository_and_resolves():
    """Comments and docstrings cite the design's rules on docs/ pages (docs/design.md for contributors), never a
    file outside the repository (a DESIGN.md, reference/*.md), and every page and heading they name exists."""
    outside = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in CODE
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"DESIGN\.md|reference/[a-z_]+\.md", line)
    ]
    assert not outside, f"pointers to files outside the repository: {outside}"
    pointers = {(p.relative_to(ROOT), page, anchor) for p in CODE for page, anchor in POINTER.findall(p.read_text())}
    assert any(page == "design.md" and anchor for _, page, anchor in pointers)
    broken = [
        f"{where}: docs/{page}" + (f"#{anchor}" if anchor else "")
        for where, page, anchor in sorted(pointers)
        if not (DOCS / page).is_file() or (anchor and anchor not in _anchors(DOCS / page))
    ]
    assert not broken, f"pointers that do not resolve: {broken}"


def test_every_page_has_one_title():
    """One H1 per page, and no H2 that repeats it (the site shows the H1 as the page's title)."""
    for page in sorted(DOCS.glob("*.md")):
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        titles = re.findall(r"^# (.+)$", text, flags=re.M)
        assert len(titles) == 1, (page.name, titles)
        title = " ".join(re.findall(r"[a-z0-9]+", titles[0].lower()))
        seconds = [" ".join(re.findall(r"[a-z0-9]+", h.lower())) for h in re.findall(r"^## (.+)$", text, flags=re.M)]
        repeated = [h for h in seconds if h.startswith(title) or title.startswith(h)]
        if page.name != "explain.md":  # another change rewrites explain.md; its title is fixed there
            assert not repeated, (page.name, titles[0], repeated)


def test_instructions_carry_no_commit_hashes():
    """A measurement says when it was taken and where its run is (benchmarks/RESULTS.md), not which commit: a hash
    in the middle of an instruction means nothing to a reader."""
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    found = [
        f"{page.name}: {m.group(0)}"
        for page in pages
        if page.name != "explain.md"  # see above
        for m in re.finditer(r"\b(?:at|commit|when) [0-9a-f]{7,12}\b", page.read_text())
    ]
    assert not found, found


_CODE_PROBE = """<script>
const found = [];
for (const code of document.querySelectorAll("pre > code")) {
  if (code.scrollWidth > code.clientWidth + 1) found.push(code.textContent.split("\\n").find(l => l.length > 60));
}
document.body.insertAdjacentHTML("beforeend", "<pre id=probe>" + JSON.stringify(found) + "</pre>");
</script>"""


@pytest.mark.parametrize("width", [1280, 800])
def test_code_blocks_fit_or_wrap_in_the_site(component, tmp_path, width):
    """In a browser window of 1280 and 800 px, no code block of the pages with the longest commands scrolls
    sideways: the Quick start's command shows whole, `demo` included (the site's stylesheet wraps code)."""
    import json

    from tests.test_incident_report import browser

    site = build_site(tmp_path)
    for page in ("index.html", "getting-started/index.html", "grafana/index.html", "otlp/index.html"):
        probe = site / page.replace("index.html", "probe.html")
        probe.write_text((site / page).read_text().replace("</body>", _CODE_PROBE + "</body>"))
        loaded = browser(
            component, f"--window-size={width},900", "--virtual-time-budget=2000", "--dump-dom", probe.as_uri()
        )
        assert loaded.returncode == 0, loaded.stderr
        scrolled = json.loads(re.search(r'<pre id="probe">(.*?)</pre>', loaded.stdout, flags=re.S)[1])
        assert scrolled == [], (page, width, scrolled)
