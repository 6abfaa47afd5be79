"""The import graph of stagetrace's own modules has no cycle, functions' imports included, and nothing but the
modules that assemble collectors imports up into ``collectors/`` (issue 56).

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


# The modules outside collectors/ that may import it: each builds a node of collectors or reads one's samples. Data
# other modules read about the series (metric specs, the GPM table, the tenants' series) and the NVML binding live in
# the core (stagetrace.metrics, gpm_metrics, tenant_metrics, nvml), so no analysis, dashboard or detector needs one.
ASSEMBLERS = {
    # `stagetrace agent` / `collect`: runs the Node the command line built, and logs the kubernetes collector's
    # diagnosis of the scrape it just took
    "stagetrace.agent",
    # the command line: the collectors' flags (add_arguments), their Options and build_node, and `collect`'s diagnosis
    "stagetrace.cli",
    # the demo's simulated nodes: recorded NVML, MPS and kubelet answers scraped by a real collector node (build_node)
    "stagetrace.demo.hardware",
    "stagetrace.demo.fabric",
}


def test_only_the_modules_that_assemble_collectors_import_them():
    edges = import_graph.graph()
    arrows = import_graph.into_collectors(edges, ASSEMBLERS)
    assert not arrows, "imports into collectors/ (move what they read to the core, beside stagetrace.metrics): " + (
        "; ".join(f"{a} -> {b}" for a, b in arrows)
    )
    # the list stays honest: a module that stopped assembling collectors leaves it
    idle = sorted(m for m in ASSEMBLERS if not any(import_graph.into_collectors({m: edges.get(m, set())})))
    assert not idle, f"no longer import collectors/, drop from ASSEMBLERS: {idle}"


def _tree(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_finds_a_loop_through_a_function_s_import_and_a_relative_one(tmp_path):
    _tree(
        tmp_path,
        {
            "src/stagetrace/__init__.py": "",
            "src/stagetrace/a.py": "from stagetrace.b import thing\n",
            "src/stagetrace/b.py": "def thing():\n    from stagetrace import a\n    return a\n",
            "src/stagetrace/c.py": "from . import d\n",
            "src/stagetrace/d.py": "from .c import value\n",
            "src/stagetrace/e.py": "import stagetrace.a\nimport numpy\n",  # into a loop, not part of one
            "exporters/__init__.py": "",
        },
    )
    edges = import_graph.graph(tmp_path)
    assert edges["stagetrace.e"] == {"stagetrace.a"}  # another package's import is no node
    assert import_graph.cycles(edges) == [["stagetrace.a", "stagetrace.b"], ["stagetrace.c", "stagetrace.d"]]


def test_a_package_that_imports_its_submodules_is_no_loop_but_using_its_names_is(tmp_path):
    _tree(
        tmp_path,
        {
            "src/stagetrace/__init__.py": "",
            "src/stagetrace/demo/__init__.py": "from stagetrace.demo import world\n"
            "from stagetrace.demo.pipeline import run\n",
            "src/stagetrace/demo/world.py": "",
            "src/stagetrace/demo/pipeline.py": "from stagetrace.demo import world\n\ndef run():\n    pass\n",
            "collectors/__init__.py": "from stagetrace.collectors.base import Collector\n\ndef available():\n    pass\n",
            "collectors/base.py": "class Collector:\n"
            "    def settings(self):\n"
            "        from stagetrace.collectors import available\n",
        },
    )
    loops = import_graph.cycles(import_graph.graph(tmp_path))
    assert loops == [["stagetrace.collectors", "stagetrace.collectors.base"]]


def test_the_checker_finds_an_import_up_into_the_collectors_and_lets_an_assembler_through(tmp_path):
    _tree(
        tmp_path,
        {
            "src/stagetrace/__init__.py": "",
            "src/stagetrace/metrics.py": "SPEC = 1\n",
            "src/stagetrace/analysis/__init__.py": "",
            "src/stagetrace/analysis/reader.py": "def read():\n    from stagetrace.collectors.gpm import TABLE\n",
            "src/stagetrace/agent.py": "from stagetrace.collectors import build\n",
            "collectors/__init__.py": "from stagetrace.collectors.gpm import TABLE\n\ndef build():\n    pass\n",
            "collectors/gpm.py": "from stagetrace.metrics import SPEC\nTABLE = [SPEC]\n",
        },
    )
    edges = import_graph.graph(tmp_path)
    assert import_graph.into_collectors(edges) == [
        ("stagetrace.agent", "stagetrace.collectors"),
        ("stagetrace.analysis.reader", "stagetrace.collectors.gpm"),
    ]  # a collector importing another, or the core, is no arrow up
    assert import_graph.into_collectors(edges, {"stagetrace.agent"}) == [
        ("stagetrace.analysis.reader", "stagetrace.collectors.gpm"),
    ]
