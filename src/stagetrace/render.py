"""What the commands print: a trace's waterfall, an explanation, the divergences, the demo's summary.

Two layouts of the same content, one for people and one for pipes:

* **On a terminal** (rich): tables that fit its width. A column that holds IDs or names (``Column.keep``:
  request and trace IDs, GPU UUIDs, cause names) is never cut or wrapped; the other columns wrap. When the
  kept columns alone do not fit, each row becomes a block of lines, its first cell on a line of its own.
  Lines of text longer than the terminal are broken by stagetrace between words or after a list's comma
  (``wrapped``), never inside an ID: left to the terminal, they were folded in the middle of a UUID. A block's
  field that runs over goes on indented under its value.
* **Piped** (stdout is no terminal, as in ``| less``, CI logs, ``| awk -F'\\t'``): plain text without box
  drawing or colour; a table is a ``# title`` line, a tab-separated header row and tab-separated rows,
  every value whole.
"""

from __future__ import annotations

import re
import shlex
from collections import Counter
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from stagetrace import conventions
from stagetrace.analysis.causes import Cause
from stagetrace.analysis.results import Baseline, DivergenceReport, Explanation
from stagetrace.lookup import ENGINE_LATENCY_PREFIX, Span, Trace, iso_ns, resources

WIDE = 110  # columns from which a trace's attributes fit beside its waterfall
_STATUS_TEXT = {"Unset": "", "Ok": "ok", "Error": "error"}
_STATUS_STYLE = {"ok": "green", "error": "bold red"}
CauseOrJson = TypeVar("CauseOrJson", Cause, dict)  # cause_groups returns each cause as it was given


@dataclass(frozen=True)
class Column:
    header: str
    keep: bool = False  # IDs and names: never cut or wrapped
    right: bool = False


Cell = str | Text


def _plain(cell: Cell) -> str:
    text = cell.plain if isinstance(cell, Text) else str(cell)
    return text.replace("\t", " ").replace("\n", " ")


def wrapped(text: Text, width: int) -> list[Text]:
    """``text`` in lines of at most ``width`` cells, broken only between words or after the comma or semicolon of a
    list (``gpu.uuids``: UUIDs joined by commas): an ID a person copies is never split (a word wider than the line
    stands alone on its own line), its styles kept. A list without spaces was one word, wider than the line, which
    the terminal then folded in the middle of a UUID."""
    out: list[Text] = []
    for paragraph in text.split("\n", allow_blank=True):
        offsets, start = [], 0
        for word in re.finditer(r"[^\s,;]+[,;]*|[,;]+", paragraph.plain):
            if word.end() - start > width and paragraph.plain[start : word.start()].strip():
                offsets.append(word.start())
                start = word.start()
        for part in paragraph.divide(offsets):
            part.rstrip()
            out.append(part)
    return out


class Output:
    """Where a command prints: a terminal (``console.is_terminal``) or a pipe; see the module docstring."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console(highlight=False, soft_wrap=True)
        self.terminal = self.console.is_terminal

    @property
    def width(self) -> int:
        return self.console.width

    def line(self, text: Cell = "", style: str | None = None, hang: str = "") -> None:
        """One line of text; on a terminal wrapped between words, each further line starting with ``hang`` (an
        indent: a wrapped setting that began at column 0 read as the start of another span's)."""
        if not self.terminal:
            self.console.file.write(_plain(text) + "\n")
            return
        for i, part in enumerate(wrapped(text if isinstance(text, Text) else Text(text), self.width - cell_len(hang))):
            self.console.print(Text.assemble(hang, part) if i else part, style=style, soft_wrap=True)

    def command(self, parts: Sequence[str], indent: str = "  ") -> None:
        """A command to paste, from its parts (words, each quoted for a shell, that stay together: a verb with its
        argument, an option with its value). It is one line in a pipe and where it fits; wider than the terminal, it
        is broken between parts, each line but the last ending in a shell's line continuation, so that it pastes as
        the same command and no part (no ID) is split."""
        if not self.terminal or cell_len(indent + " ".join(parts)) <= self.width:
            self.line(indent + " ".join(parts))
            return
        lines = [indent + parts[0]]
        for part in parts[1:]:
            if cell_len(f"{lines[-1]} {part} \\") > self.width:
                lines[-1] += " \\"
                lines.append(f"{indent}    {part}")
            else:
                lines[-1] += f" {part}"
        for line in lines:
            self.console.print(Text(line), soft_wrap=True)

    def table(self, title: str, columns: Sequence[Column], rows: Sequence[Sequence[Cell]]) -> None:
        if not rows:
            return
        if not self.terminal:
            lines = [f"# {title}"] if title else []
            lines.append("\t".join(c.header for c in columns))
            lines += ["\t".join(_plain(cell) for cell in row) for row in rows]
            self.console.file.write("\n".join(lines) + "\n")
            return
        least = _least_widths(columns, rows)
        if self.spare(columns, rows) < 0:
            self._blocks(title, columns, rows)
            return
        table = Table(
            title=title or None,
            title_justify="left",
            title_style="bold",
            box=box.SIMPLE_HEAD,
            show_edge=False,
            pad_edge=False,
            collapse_padding=True,
        )
        for column, width in zip(columns, least):
            table.add_column(
                column.header,
                no_wrap=column.keep,
                min_width=width,
                overflow="fold",
                justify="right" if column.right else "left",
            )
        for row in rows:
            table.add_row(*row)
        self.console.print(table)

    def spare(self, columns: Sequence[Column], rows: Sequence[Sequence[Cell]]) -> int:
        """The terminal's columns left over once the table's columns have their least widths (negative: it does
        not fit, and prints as blocks)."""
        return self.width - sum(_least_widths(columns, rows)) - 2 * (len(columns) - 1)

    def _blocks(self, title: str, columns: Sequence[Column], rows: Sequence[Sequence[Cell]]) -> None:
        """A table too wide for the terminal: a block per row, its first cell on a line of its own and the
        others as ``header: value`` fields below it, as many to a line as fit (a field is never broken)."""
        if title:
            self.line(Text(title, style="bold"))
        for row in rows:
            self.line(row[0] if isinstance(row[0], Text) else Text(str(row[0]), style="bold"))
            fields = [
                (column, Text.assemble(f"{column.header}: ", cell))
                for column, cell in zip(columns[1:], row[1:])
                if _plain(cell).strip()
            ]
            # a field wider than the line is alone on it: its further lines hang under its value, not at column 0,
            # where they read as the next row's first cell
            line, hang = Text("  "), ""
            for column, field in fields:
                if line.plain.strip() and cell_len(line.plain) + 3 + cell_len(field.plain) > self.width:
                    self.line(line, hang=hang)
                    line = Text("  ")
                if not line.plain.strip():
                    hang = " " * min(cell_len(f"  {column.header}: "), self.width // 2)
                line = Text.assemble(line, "   " if line.plain.strip() else "", field)
            if line.plain.strip():
                self.line(line, hang=hang)


def _least_widths(columns: Sequence[Column], rows: Sequence[Sequence[Cell]]) -> list[int]:
    """A kept column whole, any other at least as wide as its longest word (a word is never broken), and every
    header whole: "start ms" over a column of "0.00" split into two header lines at 80 columns."""
    return [
        max(cell_len(c.header), *((cell_len if c.keep else _longest_word)(_plain(row[i])) for row in rows))
        for i, c in enumerate(columns)
    ]


def _longest_word(text: str) -> int:
    return max((cell_len(word) for word in text.split()), default=0)


# --- trace --------------------------------------------------------------------------------------------------


def _depths(trace: Trace) -> dict[str, int]:
    parents = {s.span_id: s.parent_span_id for s in trace.spans}
    depths: dict[str, int] = {}
    for span in trace.spans:
        depth, cursor, seen = 0, span.parent_span_id, set()
        while cursor in parents and cursor not in seen:
            seen.add(cursor)
            depth += 1
            cursor = parents[cursor]
        depths[span.span_id] = depth
    return depths


def _bar(offset_ns: int, duration_ns: int, total_ns: int, width: int) -> Text:
    total = max(total_ns, 1)
    left = min(width - 1, int(offset_ns / total * width))
    filled = max(1, min(width - left, round(duration_ns / total * width)))
    return Text(" " * left + "█" * filled + " " * (width - left - filled), style="cyan")


def _digests(span: Span, trace: Trace) -> str:
    """A stage's digests, or the request's on the span that stands for it, as the store derived them."""
    if span.stage:
        din, dout = span.input_digest, span.output_digest
    elif span.span_id == trace.root_span_id:
        din, dout = trace.input_digest, trace.output_digest
    else:
        din = dout = ""
    if not din and not dout:
        return ""
    return f"{(din or '-')[:6]}→{(dout or '-')[:6]}"


# vLLM's gen_ai.latency.* names, shortened, in the order a request goes through the engine; others follow.
_ENGINE_LABELS = {
    "time_in_queue": "queue",
    "time_to_first_token": "ttft",
    "time_in_model_prefill": "prefill",
    "time_in_model_decode": "decode",
    "time_in_model_inference": "inference",
    "e2e": "e2e",
}


def engine_timings(span: Span) -> str:
    """``queue 12.0 · ttft 85.3 · prefill 80.1 · decode 1203.4 ms`` for an engine's request span, else ''."""
    timings = span.engine_ms
    order = [k for k in _ENGINE_LABELS if k in timings] + sorted(k for k in timings if k not in _ENGINE_LABELS)
    text = " · ".join(f"{_ENGINE_LABELS.get(k, k)} {timings[k]:.1f}" for k in order)
    return f"{text} ms" if text else ""


def _shown_attributes(attrs: dict[str, str]) -> str:
    """Settings worth seeing (batch size, index version, model), whole; content, digests, IDs and the GPU
    (its own column) are not shown."""
    return " ".join(
        f"{k}={v}"
        for k, v in attrs.items()
        if not conventions.is_content(k)
        and k not in conventions.DIGEST_KEYS
        and k != conventions.GPU_UUID
        and k not in conventions.REQUEST_ID_ALIASES
        and not k.startswith(("stagetrace.", ENGINE_LATENCY_PREFIX))
    )


BAR_WIDTH = 20  # the waterfall's bars on a wide terminal; a narrow one gives them what the other columns leave
MIN_BAR_WIDTH = 6  # narrower, a bar tells nothing: the rows print without one


def waterfall(out: Output, trace: Trace) -> None:
    """The trace: its IDs on lines of their own, then each span with where it ran (host, TP rank, GPU) and its
    settings, then its processes' resource settings (what ``explain`` weighs beside the spans' own); on a terminal
    narrower than ``WIDE`` the settings follow the table and the GPUs are named in a legend, and the bars take the
    width the other columns leave (none when too little is left: the table then prints as blocks)."""
    from stagetrace.analysis.hardware import devices

    out.line(f"request {trace.request_id or '-'}")
    out.line(f"trace {trace.trace_id}")
    out.line(f"{trace.service} · {trace.duration_ns / 1e6:.2f} ms · {len(trace.spans)} spans")
    depths = _depths(trace)
    gpus: dict[str, str] = {}  # UUID -> its short name in a narrow table
    narrow = out.terminal and out.width < WIDE

    def gpu_cell(span: Span) -> str:
        names = devices(span.attributes)[0]
        if not narrow:
            return ",".join(names)
        return ",".join(gpus.setdefault(name, f"gpu{len(gpus)}") for name in names)

    show_status = any(span.status != "Unset" for span in trace.spans)
    columns = [Column("span", keep=True), Column("start ms", right=True), Column("dur ms", right=True)]
    if show_status:
        columns.append(Column("status"))
    columns += [Column("in→out", keep=True), Column("host", keep=True), Column("gpu", keep=True)]
    if not narrow:
        columns.append(Column("attributes"))
    labels = {
        s.span_id: ("  " * depths[s.span_id] if out.terminal else "")
        + (s.stage or s.name)
        + (f"[{s.rank}]" if s.rank else "")
        for s in trace.spans
    }
    rows = []
    for span in trace.spans:
        status = _STATUS_TEXT.get(span.status, span.status)
        cells: list[Cell] = [
            labels[span.span_id],
            f"{(span.start_ns - trace.start_ns) / 1e6:.2f}",
            f"{span.duration_ns / 1e6:.2f}",
        ]
        if show_status:
            cells.append(Text(status, style=_STATUS_STYLE.get(status, "")))
        cells += [_digests(span, trace), span.resource.get("host.name", ""), gpu_cell(span)]
        if not narrow:
            cells.append(_shown_attributes(span.attributes))
        rows.append(cells)
    if out.terminal:  # the bars after the times, as wide as the terminal leaves them
        bar_width = BAR_WIDTH if not narrow else min(BAR_WIDTH, out.spare(columns, rows) - 2)
        if bar_width >= MIN_BAR_WIDTH:
            columns.insert(3, Column("", keep=True))
            for span, cells in zip(trace.spans, rows):
                cells.insert(3, _bar(span.start_ns - trace.start_ns, span.duration_ns, trace.duration_ns, bar_width))
    out.table("", columns, rows)
    for uuid, short in gpus.items():
        out.line(f"{short} = {uuid}")
    if narrow:
        settings = [(labels[s.span_id].strip(), _shown_attributes(s.attributes)) for s in trace.spans]
        if any(text for _, text in settings):
            out.line(Text("attributes", style="bold"))
            for label, text in settings:
                if text:
                    out.line(f"  {label}: {text}", hang="      ")
    found = resources(trace)
    if found:
        out.line(Text("resources: the settings of its processes (explain weighs them)", style="bold"))
        for process in found:
            settings = " ".join(f"{k}={v}" for k, v in process["attributes"].items())
            out.line(f"  {process['host'] or '-'} ({process['service']}): {settings}", hang="      ")
    for span in trace.spans:  # engine timings below the table, so they show however narrow the terminal is
        if span.engine_ms:
            out.line(f"{span.name} ({span.service}): {engine_timings(span)}")


def gpu_holders(out: Output, pods: list[dict]) -> None:
    """Which pods held the request's GPUs (the kubelet's allocations), and which of them served it."""
    rows = [[Text(p["gpu"]), p["host"], " ".join(p["held_by"]), " ".join(p["served_by"])] for p in pods]
    columns = [
        Column("gpu", keep=True),
        Column("host", keep=True),
        Column("held by (kubelet)", keep=True),
        Column("this request's pod", keep=True),
    ]
    if rows:
        out.table("pods on its GPUs", columns, rows)


def gpu_activity(out: Output, rows: list[dict]) -> None:
    """How busy each span's GPU was while it ran (GPM: Hopper and newer), where it has the series."""
    from stagetrace.analysis.activity import SHOWN

    columns = [
        Column("stage", keep=True),
        Column("gpu", keep=True),
        Column("host", keep=True),
        *(Column(key.replace("_", " "), right=True) for key in SHOWN),
    ]
    cells = [
        [
            row["stage"] + (f"[{row['rank']}]" if row.get("rank") else ""),
            Text(row["device"]),
            row["host"],
            *(f"{row[k]:.0%}" if k in row else "" for k in SHOWN),
        ]
        for row in rows
    ]
    if cells:
        out.table("GPU activity while it ran (GPM)", columns, cells)


def hardware_rises(out: Output, rises: list[dict]) -> None:
    """Error counters that rose on the request's GPUs and NICs in its stages' windows, and when (``explain``'s words:
    a window reaches a scrape or more before its stage, so "while it ran" would not always be true)."""
    rows = []
    for rise in rises:
        labels = " ".join(f"{k}={v}" for k, v in rise["labels"].items() if k not in ("uuid", "device", "gpu", "model"))
        rows.append(
            [
                Text(rise["device"], style="red"),
                rise["stage"] or "",
                rise["host"],
                rise["metric"],
                labels,
                f"+{rise['increase']:g}",
                rise.get("when", ""),
            ]
        )
    columns = [
        Column("device", keep=True),
        Column("stage"),
        Column("host", keep=True),
        Column("counter", keep=True),
        Column("labels"),
        Column("increase", right=True),
        Column("when"),
    ]
    out.table("hardware around each stage: error counters that rose", columns, rows)


def log_lines(out: Output, lines: list, first: int | None) -> None:
    """The request's log lines (otel_logs): how many, and the first ``first`` (all when None)."""
    if not lines:
        return
    shown = lines if first is None else lines[:first]
    rows = [
        [iso_ns(line.time_ns), line.severity or str(line.severity_number or ""), line.service, Text(line.body)]
        for line in shown
    ]
    more = f" (the first {len(shown)}; --logs for all)" if len(shown) < len(lines) else ""
    columns = [Column("time", keep=True), Column("severity"), Column("service"), Column("body")]
    out.table(f"{len(lines)} log line{'s' if len(lines) != 1 else ''} of the request{more}", columns, rows)


# --- explain ------------------------------------------------------------------------------------------------


def evidence(cause: Cause | dict, text=str, device=str) -> str:
    """What a cause (or its JSON) rests on, in a line; ``text`` and ``device`` render its words and its device's name
    (the incident report escapes the one and puts the other in ``<code>``)."""
    cause = _typed(cause)
    ev = cause.evidence  # the detector's own data
    if "requests_with_value" in ev:
        return text(
            f"{ev['diverged_with_value']}/{ev['requests_with_value']} with this value diverged here, "
            f"{ev['diverged_with_baseline_value']}/{ev['requests_with_baseline_value']} with the "
            "baseline's"
        )
    rank = text(f"rank {ev['rank']}: ") if ev.get("rank") else ""
    if cause.kind == "hardware" and ev.get("tenant"):
        from stagetrace.analysis.tenants import describe

        return f"{rank}{text(describe(cause.name, ev))}"
    if cause.kind == "hardware":
        shared = text(", shared with " + " ".join(ev["co_tenants"])) if ev.get("co_tenants") else ""
        return f"{rank}{text('on ')}{device(ev['device'])} {text('(' + ev['host'] + ')')}{shared}"
    if cause.kind == "rollout":
        return text(ev["rollout"]["summary"])
    if cause.kind == "nondeterminism":
        return text(ev["reason"])
    if cause.kind == "weights":
        behind = f"({ev['host']}) {ev['steps_behind']} step{'s' if ev['steps_behind'] != 1 else ''} behind"
        fleet = (
            f"{ev['gpus_on_fleet_step']}/{ev['gpus']} other GPUs on step {ev['fleet_step']} since "
            f"{_seen(ev['fleet_step_since'])}"
        )
        return f"{device(ev['gpu'])} {text(behind + '; ' + fleet)}"
    return text(ev.get("device") or "")


def _typed(cause: Cause | dict) -> Cause:
    return Cause.from_json(cause) if isinstance(cause, dict) else cause


def baseline_words(baseline: Baseline | dict) -> str:
    """How the baseline was chosen, in words: a majority is more than half of the group, else it is only the most
    common output (a plurality)."""
    if isinstance(baseline, dict):
        baseline = Baseline.from_json(baseline)
    if baseline.how == "majority":
        support, size = baseline.support, baseline.group_size
        which = "the majority output" if 2 * support > size else "the most common output"
        return f"{which}, {support} of {size} requests with this input"
    return "given with --against" if baseline.how == "explicit" else "the nearest earlier request with this input"


def cause_groups(causes: Sequence[CauseOrJson]) -> list[tuple[str, list[CauseOrJson]]]:
    """The causes (``Cause``s, or their JSON: each returned as given) as they are labelled: the strong ones best
    first, then the weak ones (less evidence) best first, each group by its recorded score; a group without causes
    left out."""
    groups = [
        ("causes, best first", [c for c in causes if not _typed(c).weak]),
        ("weak causes (less evidence), best first", [c for c in causes if _typed(c).weak]),
    ]
    return [(title, sorted(group, key=lambda c: -_typed(c).recorded_score)) for title, group in groups if group]


def explanation(out: Output, report: Explanation | dict, causes_shown: int = 8) -> None:
    """``stagetrace explain``: the verdict, the baseline it was compared with, the stages, the ranked causes
    (``report``: ``Explainer.explain``'s, or its JSON read back)."""
    if isinstance(report, dict):
        report = Explanation.from_json(report)
    # with no baseline there is nothing the request could agree with: saying "agrees" would vouch for it
    verdict = (
        Text("diverged", style="bold red")
        if report.diverged
        else Text("agrees", style="bold green")
        if report.baseline
        else Text("nothing to compare", style="bold")
    )
    out.line(f"request {report.request_id}")
    out.line(f"trace {report.trace_id}")
    out.line(Text.assemble("verdict: ", verdict))
    baseline = report.baseline
    if baseline:
        out.line(f"baseline request {baseline.request_id} ({baseline_words(baseline)})")
    out.line(Text(report.summary, style="bold"))
    if report.seed_unknown:
        out.line(f"seed unknown: {report.seed_unknown}; compared as if seeded, not excused as sampling")
    stages = []
    for stage in report.stages or ():
        name = stage.stage + (f"[{stage.rank}]" if stage.rank else "")
        if not stage.present:
            stages.append([name, Text("missing", style="red"), Text("missing", style="red")])
            continue
        stages.append(
            [
                name,
                *(
                    Text("same") if same else Text("differs", style="red")
                    for same in (stage.input_matches, stage.output_matches)
                ),
            ]
        )
    out.table("stages against the baseline", [Column("stage", keep=True), Column("input"), Column("output")], stages)
    columns = [
        Column("cause", keep=True),
        Column("kind"),
        Column("value"),
        Column("baseline"),
        Column("score", right=True),
        Column("evidence"),
    ]
    for title, group in cause_groups(report.causes[:causes_shown]):
        rows = [
            [
                cause.name,
                cause.kind,
                cause.value or "(unset)",
                cause.baseline_value or "(unset)",
                f"{cause.recorded_score:.2f}",
                evidence(cause),
            ]
            for cause in group
        ]
        out.table(title, columns, rows)


# --- divergences --------------------------------------------------------------------------------------------


def _seen(iso: str) -> str:
    """``2026-12-03T12:06:10.921682733Z`` as ``2026-12-03 12:06:10``: to the second is enough to read."""
    return iso[:19].replace("T", " ")


def _by_service(counts: dict[str, int]) -> str:
    """`` (fabric 720, rag-demo 121)`` where more than one service counts; nothing for one."""
    if len(counts) < 2:
        return ""
    return " (" + ", ".join(f"{service or '(no service)'} {n}" for service, n in counts.items()) + ")"


def divergence_groups(out: Output, report: DivergenceReport, since: str) -> None:
    """``stagetrace divergences``: a tally by cause and stage first, then each deviating request
    (``report``: ``divergences.compute``'s)."""
    analysed, deviating = report.analysed, report.deviating
    out.line(
        f"{deviating} deviating requests in the last {since}"
        + (
            f"; the latest {analysed + report.analysed_expected} analysed in full: "
            f"{analysed} deviating, {report.analysed_expected} a rollout's expected changes "
            "(--limit 0 analyses all)"
            if analysed < deviating and report.analysed_expected
            else f"; the latest {analysed} analysed in full (--limit 0 analyses all)"
            if analysed < deviating
            else ""
        )
        + (
            f"; {report.nondeterministic} sampled without a seed, not compared"
            + _by_service(report.nondeterministic_by_service)
            if report.nondeterministic
            else ""
        )
        + (
            f"; {report.seed_unknown} with the seed unknown (their engine does not record it), compared as if seeded"
            if report.seed_unknown
            else ""
        )
    )
    for rollout, _ in report.rollouts:
        out.line(f"rollout: {rollout.describe()}")
    # every deviating request, analysed in full or not: a cause of those not analysed is the setting the contrast
    # ranks first, and none when no setting stands out (a hardware fault shows only in the analysed ones)
    if report.tally_covers == "analysed" and analysed < deviating:
        out.line(
            f"the tally below covers the {analysed} analysed in full, not all {deviating}: "
            "so many take long to tally one by one (--limit 0 tallies all)"
        )
    tally = [
        [
            t.cause or ("(none found)" if t.analysed else "(no setting stands out)"),
            t.stage or "after the last stage",
            str(t.requests),
            str(t.analysed),
            " ".join(t.hosts),
            _seen(t.first_seen),
            _seen(t.last_seen),
        ]
        for t in report.tally
    ]
    out.table(
        "by cause",
        [
            Column("cause", keep=True),
            Column("stage", keep=True),
            Column("requests", right=True),
            Column("analysed", right=True),
            Column("hosts"),
            Column("first seen", keep=True),
            Column("last seen", keep=True),
        ],
        tally,
    )
    rows = []
    for group in report.groups:
        for item in group.deviating:
            top = item.top
            rows.append(
                [
                    item.request_id,
                    item.stage or "after the last stage",
                    item.host,
                    item.device,
                    top.name if top else "-",
                    f"{top.value} vs {top.baseline_value}" if top else "",
                    group.input_digest[:8],
                    f"{group.support}/{group.requests}",
                ]
            )
    columns = [
        Column("request", keep=True),
        Column("stage", keep=True),
        Column("host", keep=True),
        Column("device", keep=True),
        Column("top cause", keep=True),
        Column("value vs baseline"),
        Column("input"),
        Column("majority"),
    ]
    out.table("deviating requests", columns, rows)
    for item in (i for group in report.groups for i in group.deviating if i.seed_unknown):
        out.line(f"seed unknown: {item.request_id}: {item.seed_unknown}")


# --- demo ---------------------------------------------------------------------------------------------------


@contextmanager
def progress_bar(description: str, enabled: bool = True):
    """A ``progress(done, total)`` callback drawing a bar on stderr (nothing when disabled or not a terminal)."""
    console = Console(stderr=True)
    if not enabled or not console.is_terminal:
        yield None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(description, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


NO_FAULT = "(no injected fault)"  # a deviating output no fault explains: never expected, shown if it happens


def deviations_by_cause(result) -> dict[tuple[str, str], list[str]]:
    """The deviating outputs by the fault that changed them, (stage, cause) → request IDs, most requests first (ties
    by cause): every deviating output counted once, so that the rows add up to the headline. Expected changes and
    nondeterministic requests are never deviating (``demo._conclude``) and so are never rows here."""
    faults = {t.request_id: (t.stage, t.cause) for t in result.truth if t.deviation}
    causes: dict[tuple[str, str], list[str]] = {}
    for request_id in result.deviating:
        causes.setdefault(faults.get(request_id, ("", NO_FAULT)), []).append(request_id)
    return dict(sorted(causes.items(), key=lambda kv: (kv[0][1] == NO_FAULT, -len(kv[1]), kv[0][1], kv[0][0])))


def demo_counts(result) -> list[str]:
    """The headline and what it leaves out, each counted and said for what it is: outputs a fault changed that
    deviate from nothing (no output of their input is more common), the expected changes of the rollout waves,
    and the requests sampled without a seed."""
    deviating = set(result.deviating)
    unseen = sum(1 for t in result.truth if t.deviation and t.request_id not in deviating)
    expected = Counter(t.cause for t in result.truth if t.expected)
    nondeterministic = sum(1 for t in result.truth if t.nondeterministic)
    explained = deviating <= {t.request_id for t in result.truth if t.deviation}
    lines = [
        f"deviating outputs: {len(deviating)} (same input and fleet settings, an output other than the most "
        "common one)" + (", each caused by an injected fault" if explained else "")
    ]
    left_out = []
    if unseen:
        left_out.append(
            f"{unseen} outputs a fault changed where no output of their input is the most common, so none deviates"
        )
    for cause, n in sorted(expected.items()):
        left_out.append(f"{n} expected changes while {cause} rolled out (hosts ahead of or behind the fleet)")
    if nondeterministic:
        left_out.append(
            f"{nondeterministic} nondeterministic requests (sampled without a seed: outputs differ by design)"
        )
    if left_out:
        lines.append("not counted as deviating: " + "; ".join(left_out))
    return lines


def demo_summary(out: Output, result, command: str = "stagetrace", store: str = "") -> None:
    """What the demo did, what deviated and why, and the next commands to type (``command``: how to start stagetrace,
    for a shell; ``store``: the store to name in them, if any)."""
    out.line(
        f"served {result.requests} requests on {len(result.nodes)} nodes ({', '.join(result.nodes)}): "
        f"{result.spans} spans, {result.metric_samples} hardware samples"
    )
    for line in demo_counts(result):
        out.line(line)
    if result.fabric_spans:
        out.line(
            f"and the half hour before: a TP=16 pair on two rails, RL weight syncs, {result.fabric_spans} spans and "
            f"{result.fabric_samples} samples (Fabric and Weights dashboards; truth in stagetrace_demo_fabric)"
        )
    causes = deviations_by_cause(result)
    out.table(
        f"the {len(result.deviating)} deviating outputs by cause (ground truth: the injected fault)",
        [
            Column("cause", keep=True),
            Column("stage", keep=True),
            Column("requests", right=True),
            Column("e.g.", keep=True),
        ],
        [[cause, stage, str(len(ids)), ids[0]] for (stage, cause), ids in causes.items()],
    )
    examples = [ids[0] for (_, cause), ids in causes.items() if cause != NO_FAULT][:3]
    if examples:
        out.line("next, look one up and ask why it deviates:")
        store_option = [f"--store {shlex.quote(store)}"] if store else []
        for request_id in examples:
            for verb in ("trace", "explain"):
                out.command([command, f"{verb} {shlex.quote(request_id)}", *store_option])
        out.command([command, "divergences", *store_option])


__all__ = [
    "Column",
    "Output",
    "WIDE",
    "demo_counts",
    "demo_summary",
    "deviations_by_cause",
    "divergence_groups",
    "engine_timings",
    "evidence",
    "explanation",
    "gpu_activity",
    "gpu_holders",
    "hardware_rises",
    "progress_bar",
    "resources",
    "waterfall",
]
