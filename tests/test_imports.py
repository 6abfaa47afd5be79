"""The import graph of stagetrace's own modules has no cycle, functions' imports included (issue 56).

The graph is read from the source with ``ast`` (``tests/import_graph.py``), so an import hidden inside a function to
dodge a load-time loop counts as the loop it is.
"""

from __future__ import annotations

from tests import import_graph


def test_the_modules_import_each_other_without_a_cycle():
    edges = import_graph.graph()
    assert len(edges) > 50 and sum(map(len, edges.values())) > 200  # the whole tree was read, not an empty one
    loops = import_graph.cycles(edges)
    assert not loops, "import cycles (move the shared piece to a module both can import): " + "; ".join(
        " <-> ".join(loop) for loop in loops
    )


def _tree(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_finds_a_loop_through_a_function_s_import_and_a_relative_one(tmp_path):
    _tree(tmp_path, {
        "src/stagetrace/__init__.py": "",
        "src/stagetrace/a.py": "from stagetrace.b import thing\n",
        "src/stagetrace/b.py": "def thing():\n    from stagetrace import a\n    return a\n",
        "src/stagetrace/c.py": "from . import d\n",
        "src/stagetrace/d.py": "from .c import value\n",
        "src/stagetrace/e.py": "import stagetrace.a\nimport numpy\n",  # into a loop, not part of one
        "exporters/__init__.py": "",
    })
    edges = import_graph.graph(tmp_path)
    assert edges["stagetrace.e"] == {"stagetrace.a"}  # another package's import is no node
    assert import_graph.cycles(edges) == [["stagetrace.a", "stagetrace.b"], ["stagetrace.c", "stagetrace.d"]]


def test_a_package_that_imports_its_submodules_is_no_loop_but_using_its_names_is(tmp_path):
    _tree(tmp_path, {
        "src/stagetrace/__init__.py": "",
        "src/stagetrace/demo/__init__.py": "from stagetrace.demo import world\n"
                                           "from stagetrace.demo.pipeline import run\n",
        "src/stagetrace/demo/world.py": "",
        "src/stagetrace/demo/pipeline.py": "from stagetrace.demo import world\n\ndef run():\n    pass\n",
        "collectors/__init__.py": "from stagetrace.collectors.base import Collector\n\ndef available():\n    pass\n",
        "collectors/base.py": "class Collector:\n"
                              "    def settings(self):\n"
                              "        from stagetrace.collectors import available\n",
    })
    loops = import_graph.cycles(import_graph.graph(tmp_path))
    assert loops == [["stagetrace.collectors", "stagetrace.collectors.base"]]
