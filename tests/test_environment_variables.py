"""Every ``STAGETRACE_*`` variable is registered once, with its default, grammar and doc, and the docs' table is the
one generated from the registry (``stagetrace.environment_variables``, issue 56)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from stagetrace import environment_variables as ev
from stagetrace.collectors import all_settings

REPOSITORY = Path(__file__).resolve().parent.parent
SOURCE = ("src/stagetrace", "collectors", "exporters", "dashboards")
PAGE = REPOSITORY / "docs" / "configuration.md"
NAME = re.compile(r"\bSTAGETRACE_[A-Z0-9_]+")


def _source_files():
    for folder in SOURCE:
        yield from sorted((REPOSITORY / folder).rglob("*.py"))
    yield from sorted(p for p in (REPOSITORY / "deploy").rglob("*") if p.is_file())


def test_every_stagetrace_name_in_the_source_and_the_deployment_is_registered():
    unregistered = set()
    for path in _source_files():
        for name in NAME.findall(path.read_text(errors="replace")):
            if name.endswith("_"):  # a family written STAGETRACE_CLICKHOUSE_*: some registered name starts so
                if not any(v.startswith(name) for v in ev.VARIABLES):
                    unregistered.add(f"{name}* ({path.relative_to(REPOSITORY)})")
            elif name not in ev.VARIABLES:
                unregistered.add(f"{name} ({path.relative_to(REPOSITORY)})")
    assert not unregistered, "register these in stagetrace.environment_variables: " + ", ".join(sorted(unregistered))


def test_each_constant_is_its_own_name_and_every_entry_is_complete():
    constants = {k: v for k, v in vars(ev).items() if k.startswith("STAGETRACE_")}
    assert constants == {name: name for name in ev.VARIABLES}
    for v in ev.VARIABLES.values():
        assert v.default and v.value and v.doc and v.topic, v.name
        assert (REPOSITORY / "docs" / v.page).is_file(), f"{v.name}: docs/{v.page} is not a page"
        assert "\n" not in v.doc, f"{v.name}: its doc is one line"


def test_the_docs_table_is_the_generated_one():
    page = PAGE.read_text()
    assert ev.rewritten(page) == page, (
        "docs/configuration.md's table differs from the registry: "
        "run python -m stagetrace.environment_variables --write docs/configuration.md"
    )
    rows = [line for line in page.splitlines() if line.startswith("| `STAGETRACE_")]
    assert [row.split("`")[1] for row in rows] == list(ev.VARIABLES)


def test_writing_the_table_replaces_only_what_lies_between_the_markers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"# Title\n\nbefore\n\n{ev.BEGIN}\nstale table\n{ev.END}\n\nafter\n")
    assert ev.main(["--write", str(page)]) == 0
    text = page.read_text()
    assert "stale table" not in text and text.startswith("# Title\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert ev.rewritten(text) == text  # a second run changes nothing
    page.write_text("# A page without the markers\n")
    assert ev.main(["--write", str(page)]) == 1 and page.read_text() == "# A page without the markers\n"
    with pytest.raises(ValueError, match="markers"):
        ev.rewritten("no markers")


def test_the_collectors_settings_read_registered_variables_with_the_registered_default():
    for setting in all_settings():
        for name in (n for n in setting.env if n.startswith("STAGETRACE_")):
            registered = ev.VARIABLES.get(name)
            assert registered is not None, f"{setting.flag}: {name} is not registered"
            shown = setting.shown_default or (setting.default if isinstance(setting.default, str) else "")
            if shown and name != ev.STAGETRACE_NCCL_DIR:  # its default is the next variable, NCCL's own
                assert registered.default.replace("`", "") == shown, (
                    f"{name}: registered {registered.default}, reads {shown}"
                )


def test_the_reading_sites_name_variables_through_the_registry_s_constants():
    """A string literal that is exactly a variable's name, outside the registry, is a second place that name is
    written (docstrings and messages that mention a name inside a sentence are not)."""
    literal = set()
    for path in _source_files():
        relative = str(path.relative_to(REPOSITORY))
        if path.suffix != ".py" or path.name == "environment_variables.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), relative)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in ev.VARIABLES:
                literal.add(f"{relative}:{node.lineno} {node.value}")
    assert not literal, "use stagetrace.environment_variables' constant: " + ", ".join(sorted(literal))
