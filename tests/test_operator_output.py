"""What an operator sees: the commands on a real terminal of 80 and 200 columns (a pseudo-terminal whose
window size is set, as a terminal emulator sets it) and through a pipe, on a store the demo filled.

The class of case: an ID the user must copy (request ID, trace ID, GPU UUID) is cut or wrapped, or a pipe
gets box drawing. Each output is checked against the IDs its own ``--json`` twin names: every one appears
whole on one line, and nothing that looks like one of them appears cut.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from stagetrace.render import Output
from tests.terminal import run_on_terminal

STAGETRACE = [sys.executable, "-m", "stagetrace"]
# what request IDs, trace IDs and GPU UUIDs look like in the demo, however short a cut left them
ID_LIKE = re.compile(r"req-[0-9a-f]+|GPU-[0-9a-f-]+")
BOX = re.compile("[─━│┃┏┓┗┛┡┩╇┳┻█]")


@pytest.fixture
def demo_store(cli_demo):
    return cli_demo


def json_of(*argv: str) -> dict:
    run = subprocess.run([*STAGETRACE, *argv, "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


ID_KEYS = ("request_id", "trace_id", "baseline_request_id")


def ids_in(document) -> set[str]:
    """Every request ID, trace ID and GPU UUID a JSON document names (digests, also 32 hex digits, are not IDs)."""
    found: set[str] = set()

    def walk(node, key=""):
        if isinstance(node, dict):
            for k, value in node.items():
                walk(value, k)
        elif isinstance(node, list):
            for value in node:
                walk(value, key)
        elif isinstance(node, str):
            if key in ID_KEYS and node:
                found.add(node)
            found.update(m for m in ID_LIKE.findall(node) if _whole(m))

    walk(document)
    return found


def _whole(text: str) -> bool:
    return bool(re.fullmatch(r"req-[0-9a-f]{12}|GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", text))


def assert_ids_whole(text: str, expected: set[str]) -> None:
    lines = text.splitlines()
    for identifier in expected:
        assert any(identifier in line for line in lines), f"{identifier} is not whole on any line:\n{text}"
    cut = [m for m in ID_LIKE.findall(text) if not _whole(m)]
    assert not cut, f"IDs cut or wrapped: {cut}\n{text}"


def commands(dsn: str, demo: dict) -> dict[str, list[str]]:
    hardware = next(t["request_id"] for t in demo["truth"] if t["cause"].startswith("gpu_"))
    return {
        "trace": ["trace", hardware, "--store", dsn],
        "explain": ["explain", hardware, "--store", dsn],
        "divergences": ["divergences", "--since", "1d", "--store", dsn],
    }


@pytest.mark.parametrize("columns", [80, 200])
@pytest.mark.parametrize("command", ["trace", "explain", "divergences"])
def test_on_a_terminal_every_id_is_whole_on_one_line(demo_store, command, columns):
    dsn, demo = demo_store
    argv = commands(dsn, demo)[command]
    expected = ids_in(json_of(*argv))
    if command == "divergences":  # the rows name requests, their devices and baselines' are in the JSON only
        found = json_of(*argv)
        expected = {i["request_id"] for g in found["groups"] for i in g["deviating"]}
        expected |= {d for g in found["groups"] for i in g["deviating"] for d in i["device"].split(",") if d}
    status, shown = run_on_terminal([*STAGETRACE, *argv], columns)
    assert status == 0, shown
    assert expected and "Traceback" not in shown
    assert_ids_whole(shown, expected)


def test_a_list_of_gpu_uuids_wraps_between_uuids_at_80_columns(demo_store):
    """A cause whose value is a stage's GPU UUIDs joined by commas (the all-reduce's ``gpu.uuids``, as wide as four
    UUIDs): at 80 columns it wraps after a comma, never inside a UUID (it was one word, wider than the line, which
    the terminal folded wherever the line ended)."""
    dsn, demo = demo_store
    request = next(t["request_id"] for t in demo["truth"] if t["cause"] == "allreduce.algorithm")
    report = json_of("explain", request, "--store", dsn)
    lists = [c for c in report["causes"][:8] if c["name"] == "gpu.uuids" and "," in c["value"]]
    assert lists, [c["name"] for c in report["causes"]]
    status, shown = run_on_terminal([*STAGETRACE, "explain", request, "--store", dsn], 80)
    assert status == 0, shown
    uuids = {u for c in lists for u in (c["value"] + "," + c["baseline_value"]).split(",") if u}
    assert max(map(len, shown.splitlines())) <= 80
    assert_ids_whole(shown, uuids | {request, report["trace_id"]})


def test_trace_at_80_columns_shows_host_rank_gpu_and_settings(demo_store):
    dsn, demo = demo_store
    argv = commands(dsn, demo)["trace"]
    trace = json_of(*argv)
    status, shown = run_on_terminal([*STAGETRACE, *argv], 80)
    assert status == 0, shown
    hosts = {s["host"] for s in trace["spans"]}
    assert all(host in shown for host in hosts)
    assert all(f"{s['stage']}[{s['rank']}]" in shown for s in trace["spans"] if s.get("rank"))
    decode = next(s for s in trace["spans"] if s.get("stage") == "decode")
    assert decode["attributes"]["gpu.uuid"] in shown
    assert f"decode.batch_size={decode['attributes']['decode.batch_size']}" in shown  # settings, not hidden


def test_trace_shows_the_resource_setting_explain_blames_with_its_header_whole_at_80_columns(demo_store):
    """The demo's attention-backend request: ``explain`` blames a resource attribute (the process's, not a span's);
    ``trace`` shows it with its value, for the request and (a neighbour with the other value) for its baseline,
    in the JSON's ``resources`` too. At 80 columns the header is one line ("start ms" was split over two), the bars
    are drawn and fit, and a wrapped setting hangs under its span instead of starting at column 0."""
    dsn, demo = demo_store
    request = next(t["request_id"] for t in demo["truth"] if t["cause"] == "engine.attention_backend")
    report = json_of("explain", request, "--store", dsn)
    top = report["causes"][0]
    assert top["name"] == "engine.attention_backend" and top["value"] != top["baseline_value"], top
    for who, value in ((request, top["value"]), (report["baseline"]["request_id"], top["baseline_value"])):
        found = json_of("trace", who, "--store", dsn)
        resources = found["resources"]
        assert any(r["attributes"].get(top["name"]) == value and r["host"] for r in resources), resources
        status, shown = run_on_terminal([*STAGETRACE, "trace", who, "--store", dsn], 80)
        assert status == 0, shown
        lines = shown.splitlines()
        assert any(f"{top['name']}={value}" in line for line in lines), shown
        assert f"{top['name']}={top['value'] if value != top['value'] else top['baseline_value']}" not in shown
        header = next(line for line in lines if line.startswith("span "))
        assert "start ms" in header and "dur ms" in header, header
        table = lines[lines.index(header) : next(i for i, line in enumerate(lines) if line.startswith("gpu0 ="))]
        assert max(map(len, table)) <= 80 and all("█" in line for line in table[2:]), table
        settings = lines[lines.index("attributes") + 1 :]
        assert all(line.startswith("  ") for line in settings[:8]), settings[:8]  # each wrapped line indented


@pytest.mark.parametrize("command", ["trace", "explain", "divergences"])
def test_piped_output_is_plain_tab_separated_text(demo_store, command):
    dsn, demo = demo_store
    argv = commands(dsn, demo)[command]
    run = subprocess.run([*STAGETRACE, *argv], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert not BOX.search(run.stdout) and "\x1b[" not in run.stdout  # no box drawing, no colour
    assert_ids_whole(run.stdout, ids_in(json_of(*argv)) if command != "divergences" else set())
    # each table: a header row, then rows with as many tab-separated fields
    for block in re.split(r"\n(?=# )|\n\n", run.stdout):
        rows = [line.split("\t") for line in block.splitlines() if "\t" in line]
        assert all(len(row) == len(rows[0]) for row in rows), block


def test_divergences_open_with_a_tally_that_counts_the_rows(demo_store):
    dsn, demo = demo_store
    found = json_of("divergences", "--since", "1d", "--store", dsn)
    rows = [i for g in found["groups"] for i in g["deviating"]]
    # every deviating request is tallied, those analysed in full among them
    assert sum(t["requests"] for t in found["tally"]) == found["deviating"] >= len(rows) > 0
    assert sum(t["analysed"] for t in found["tally"]) == len(rows) == found["analysed"]
    assert all(t["hosts"] and t["first_seen"] <= t["last_seen"] for t in found["tally"])
    assert all(i["host"] for i in rows)
    run = subprocess.run(
        [*STAGETRACE, "divergences", "--since", "1d", "--store", dsn], capture_output=True, text=True, timeout=300
    )
    assert run.stdout.index("# by cause") < run.stdout.index("# deviating requests")
    top = found["tally"][0]
    assert f"{top['cause']}\t{top['stage']}\t{top['requests']}\t{top['analysed']}\t" in run.stdout
    # the header says what was left out and how to have it: the unseeded requests by service (here the demo's RL
    # tenant; named when more than one service has some), and the way to analyse every deviating request
    by_service = found["nondeterministic_by_service"]
    assert by_service and sum(by_service.values()) == found["nondeterministic"]
    header = run.stdout.splitlines()[0]
    assert all(f"{service} {n}" in header for service, n in by_service.items()) == (len(by_service) > 1), header
    assert ("--limit 0 analyses all" in header) == (found["analysed"] < found["deviating"]), header


@pytest.mark.parametrize("columns", [80, 200, None])  # None: piped
def test_the_demo_summary_keeps_its_example_ids_whole(tmp_path, columns):
    argv = [*STAGETRACE, "demo", "--requests", "150", "--store", f"chdb://{tmp_path / 'store'}"]
    if columns is None:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        status, shown = run.returncode, run.stdout
        assert not BOX.search(shown) and "\x1b[" not in shown
    else:
        status, shown = run_on_terminal(argv, columns)
    assert status == 0, shown
    examples = set(re.findall(r"explain (req-[0-9a-f]+)", shown))
    assert examples and "deviating outputs:" in shown
    assert_ids_whole(shown, examples)


@pytest.mark.parametrize("width", [40, 60, 80])
def test_a_command_wider_than_the_terminal_pastes_as_the_same_command(width):
    """The next commands the demo prints, wider than the terminal (a long interpreter path, a store under a deep
    temporary directory, with a space): broken only between their parts, each line but the last ending in a line
    continuation, the verb beside its request ID; a shell reads back the same command. Piped, it is one line."""
    parts = [
        shlex.quote("/opt/venvs/stage trace/bin/python") + " -m stagetrace",
        "explain req-3f9a1c0b",
        "--store " + shlex.quote("chdb:///tmp/pytest-of-root/pytest-30/with space/store"),
    ]
    shown = io.StringIO()
    Output(Console(file=shown, width=width, force_terminal=True)).command(parts)
    lines = shown.getvalue().splitlines()
    assert len(lines) > 1 and all(line.endswith(" \\") for line in lines[:-1]) and not lines[-1].endswith("\\")
    # a part wider than the terminal stands alone on its line
    assert all(len(line) <= width or line.strip().removesuffix(" \\") in parts for line in lines)
    assert any("explain req-3f9a1c0b" in line for line in lines)
    assert shlex.split(shown.getvalue().replace("\\\n", " ")) == shlex.split(" ".join(parts))
    piped = io.StringIO()
    Output(Console(file=piped)).command(parts)
    assert piped.getvalue() == "  " + " ".join(parts) + "\n"


# --- paper cuts: each a one-line answer ---------------------------------------------------------------------


def one_line_failure(*argv: str, env: dict | None = None) -> str:
    run = subprocess.run([*STAGETRACE, *argv], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("stagetrace: ") and "Traceback" not in run.stderr
    return run.stderr


def test_durations_take_days_and_weeks_and_a_negative_one_is_one_line(demo_store):
    dsn, _ = demo_store
    for since in ("10d", "2w"):
        assert json_of("divergences", "--since", since, "--store", dsn)["deviating"] > 0
    message = one_line_failure("divergences", "--since", "-1h", "--store", dsn)
    assert "--since: '-1h' is not a positive duration" in message and "usage:" not in message


def test_an_unreachable_server_is_one_line_naming_the_reason():
    message = one_line_failure("trace", "some-request", "--store", "http://127.0.0.1:9/")
    assert "cannot reach ClickHouse at http://default@127.0.0.1:9/stagetrace: connection refused" in message
    assert "HTTPConnectionPool" not in message and "Driver Exception" not in message


def test_a_read_command_never_creates_a_store(tmp_path):
    typo = tmp_path / "stroe"
    for argv in (["trace", "r-1"], ["explain", "r-1"], ["divergences"]):
        message = one_line_failure(*argv, "--store", f"chdb://{typo}")
        assert f"no store at {typo} (a typo? the default is " in message
    assert not typo.exists()
    # the default store, not made yet: no "a typo?" for the path the user never typed
    fresh = {k: v for k, v in os.environ.items() if k != "STAGETRACE_STORE"} | {
        "XDG_DATA_HOME": str(tmp_path / "fresh")
    }
    message = one_line_failure("trace", "r-1", env=fresh)
    assert f"no store at {tmp_path / 'fresh' / 'stagetrace' / 'store'} (the default store; `stagetrace demo`" in message


def test_a_store_on_a_read_only_filesystem_is_read_in_place(demo_store, tmp_path):
    """A real read-only bind mount of the demo's store (as a snapshot or another host's disk is mounted):
    the read commands give what they give on the writable store."""
    import os
    import shutil

    dsn, demo = demo_store
    if os.geteuid() != 0 or not shutil.which("mount"):
        message = "a read-only bind mount needs root and mount(8)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    mounted = tmp_path / "read-only"
    mounted.mkdir()
    subprocess.run(["mount", "--bind", dsn.removeprefix("chdb://"), str(mounted)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(mounted)], check=True)
        assert not os.access(mounted, os.W_OK)
        argv = commands(dsn, demo)["trace"]
        on_the_mount = [*argv[:-1], f"chdb://{mounted}"]
        assert json_of(*on_the_mount) == json_of(*argv)
        found = json_of("divergences", "--since", "1d", "--store", f"chdb://{mounted}")
        assert found["deviating"] == json_of("divergences", "--since", "1d", "--store", dsn)["deviating"] > 0
    finally:
        subprocess.run(["umount", str(mounted)], check=True)


@settings(max_examples=200, deadline=None)
@given(
    words=st.lists(
        st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=50), min_size=1, max_size=30
    ),
    width=st.integers(min_value=10, max_value=120),
)
def test_free_text_breaks_only_between_words(words, width):
    """A free-text line on a terminal (explain's verdict, trace's attribute names): broken only between words or
    after the comma or semicolon of a list (UUIDs joined by commas); every line fits, or holds one piece wider than
    the line alone; every piece (an ID to copy) comes out whole, in order."""
    from rich.text import Text

    from stagetrace.render import wrapped

    def pieces(text: str) -> list[str]:
        return re.findall(r"[^\s,;]+[,;]*|[,;]+", text)

    lines = [line.plain for line in wrapped(Text(" ".join(words)), width)]
    assert [p for line in lines for p in pieces(line)] == [p for word in words for p in pieces(word)]
    assert all(len(line) <= width or len(pieces(line)) == 1 for line in lines)


def test_the_divergences_header_counts_unseeded_requests_by_service():
    import io

    from rich.console import Console

    from stagetrace.analysis.results import Baseline, DeviatingRequest, DivergenceReport
    from stagetrace.render import Output, divergence_groups

    piped = io.StringIO()
    # the header counts the requests analysed in full; no group holds them here, so no row shows them
    analysed = [
        DeviatingRequest(
            request_id=f"req-{n}",
            trace_id=f"{n:032x}",
            service="rag-demo",
            host="a",
            start_ns=0,
            input_digest="in",
            baseline=Baseline("base", "majority", 2, 3),
            stage="decode",
            origin=None,
            causes=[],
            summary="",
            device="",
        )
        for n in range(76)
    ]
    found = DivergenceReport(
        since_ns=3600 * 10**9,
        deviating=145,
        analysed_expected=0,
        nondeterministic_by_service={"fabric": 720, "rag-demo": 121},
        rollouts=[],
        tally=[],
        tally_covers="all",
        groups=[],
        requests=analysed,
        detected_ms=0,
    )
    divergence_groups(Output(Console(file=piped)), found, "1h")
    assert piped.getvalue().splitlines()[0] == (
        "145 deviating requests in the last 1h; the latest 76 analysed in full (--limit 0 analyses all); "
        "841 sampled without a seed, not compared (fabric 720, rag-demo 121)"
    )


def test_a_baseline_is_a_majority_only_when_it_is_more_than_half_and_causes_are_grouped_as_labelled():
    """ "The majority output, 8 of 21" was a plurality: under half it is the most common output. A weak cause
    scoring 0.88 listed after strong ones scoring 0.18 under "best first" read as a misordering: the strong and the
    weak are shown apart, each best first."""
    from stagetrace.render import baseline_words, cause_groups

    assert baseline_words({"how": "majority", "support": 8, "group_size": 21}).startswith(
        "the most common output, 8 of"
    )
    assert baseline_words({"how": "majority", "support": 11, "group_size": 21}).startswith("the majority output, 11 of")
    assert baseline_words({"how": "majority", "support": 2, "group_size": 4}).startswith("the most common output")
    causes = [
        {"name": "a", "score": 0.18},
        {"name": "b", "score": 0.40},
        {"name": "w", "score": 0.88, "weak": True},
        {"name": "v", "score": 0.30, "weak": True},
    ]
    assert [(title, [c["name"] for c in group]) for title, group in cause_groups(causes)] == [
        ("causes, best first", ["b", "a"]),
        ("weak causes (less evidence), best first", ["w", "v"]),
    ]
    assert [title for title, _ in cause_groups(causes[:2])] == ["causes, best first"]


def test_a_request_with_nothing_to_compare_is_not_said_to_agree():
    """explain of a request whose input no other request had: the verdict says there is nothing to compare, not
    "agrees" (a newcomer read the quickstart's lone request as vouched for)."""
    from stagetrace.render import explanation

    report = {
        "request_id": "quickstart-0002",
        "trace_id": "ab" * 16,
        "diverged": False,
        "baseline": None,
        "summary": "no other request with the same input in the window: nothing to compare against",
        "stages": [],
        "causes": [],
    }
    buffer = io.StringIO()
    explanation(Output(Console(file=buffer, width=80)), report)
    assert "verdict: nothing to compare" in buffer.getvalue() and "agrees" not in buffer.getvalue()


def test_a_long_value_at_80_columns_hangs_under_its_field_and_prose_breaks_between_words():
    """At 80 columns a cause whose value is a list of GPU UUIDs (the all-reduce's ``gpu.uuids``) makes the table
    print as blocks; the value's further lines were at column 0, where they read as another row. They hang under the
    value, every UUID whole. The summary, wider than the line, is broken between words (docs/explain.md says so);
    a neighbour cause with a short value keeps its fields on one line."""
    from stagetrace.render import explanation

    uuids = [f"GPU-{i:08x}-1111-2222-3333-{i:012x}" for i in range(4)]
    report = {
        "request_id": "req-0123456789ab",
        "trace_id": "ab" * 16,
        "diverged": True,
        "baseline": {"request_id": "req-ba0123456789", "how": "majority", "support": 11, "group_size": 21},
        "summary": "allreduce's output differs from the baseline's; its inputs are the same, so the change "
        "began in allreduce: the ranks ran another algorithm on other devices",
        "stages": [],
        "causes": [
            {
                "name": "gpu.uuids",
                "kind": "attribute",
                "value": ",".join(uuids),
                "baseline_value": ",".join(reversed(uuids)),
                "score": 0.9,
                "device": "",
            },
            {
                "name": "allreduce.algorithm",
                "kind": "attribute",
                "value": "tree",
                "baseline_value": "ring",
                "score": 0.8,
                "device": "",
            },
        ],
    }
    buffer = io.StringIO()
    explanation(Output(Console(file=buffer, width=80, force_terminal=True, color_system=None)), report)
    lines = buffer.getvalue().splitlines()
    assert max(map(len, lines)) <= 80, lines
    assert_ids_whole(buffer.getvalue(), set(uuids) | {"req-0123456789ab", "req-ba0123456789"})
    for header in ("value: ", "baseline: "):
        (at,) = [i for i, line in enumerate(lines) if line.startswith(f"  {header}{uuids[0][:4]}")]
        column = len(f"  {header}")
        further = lines[at + 1]
        assert further.startswith(" " * column) and further[column : column + 4] == "GPU-", (header, lines)
    (first,) = [i for i, line in enumerate(lines) if line.startswith("allreduce's output")]
    assert " ".join(lines[first : first + 2]) == report["summary"], lines  # two lines, broken at a space
    assert any(line.strip().startswith("kind: attribute") and "value: tree" in line for line in lines), lines
