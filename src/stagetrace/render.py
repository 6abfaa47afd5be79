"""Terminal rendering (rich): a trace as a waterfall, the demo's progress and summary."""

from __future__ import annotations

from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from stagetrace.lookup import Trace
from stagetrace.tracing import (
    INPUT_DIGEST,
    OUTPUT_DIGEST,
    REQUEST_ID,
    STAGE,
    STAGE_INPUT_DIGEST,
    STAGE_OUTPUT_DIGEST,
)

_SHOWN_ELSEWHERE = {REQUEST_ID, STAGE, INPUT_DIGEST, OUTPUT_DIGEST, STAGE_INPUT_DIGEST, STAGE_OUTPUT_DIGEST}
_MAX_ATTRIBUTES = 4
_STATUS_TEXT = {"Unset": Text(""), "Ok": Text("ok", style="green"), "Error": Text("error", style="bold red")}


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


def _digests(attrs: dict[str, str]) -> str:
    din = attrs.get(STAGE_INPUT_DIGEST) or attrs.get(INPUT_DIGEST)
    dout = attrs.get(STAGE_OUTPUT_DIGEST) or attrs.get(OUTPUT_DIGEST)
    if not din and not dout:
        return ""
    return f"{(din or '-')[:6]}→{(dout or '-')[:6]}"


def _key_attributes(attrs: dict[str, str]) -> str:
    shown = [(k, v) for k, v in attrs.items() if k not in _SHOWN_ELSEWHERE and not k.startswith("stagetrace.")]
    text = " ".join(f"{k}={v if len(v) <= 24 else v[:23] + '…'}" for k, v in shown[:_MAX_ATTRIBUTES])
    if len(shown) > _MAX_ATTRIBUTES:
        text += f" (+{len(shown) - _MAX_ATTRIBUTES})"
    return text


def waterfall(trace: Trace, width: int = 160) -> Table:
    """The trace as a table that fits ``width`` columns: attributes and a wide bar only where there is room."""
    title = f"request {trace.request_id or '-'} · trace {trace.trace_id} · {trace.service} · {trace.duration_ns / 1e6:.2f} ms"
    bar_width = 20 if width >= 100 else 10
    show_status = any(span.status != "Unset" for span in trace.spans)
    show_attributes = width >= 110
    table = Table(title=title, title_justify="left", expand=False, pad_edge=False)
    table.add_column("span", no_wrap=True)
    table.add_column("start ms", justify="right", no_wrap=True)
    table.add_column("dur ms", justify="right", no_wrap=True)
    table.add_column("", no_wrap=True)
    if show_status:
        table.add_column("status", no_wrap=True)
    table.add_column("in→out", no_wrap=True)
    if show_attributes:
        table.add_column("attributes", overflow="fold", min_width=12)
    depths = _depths(trace)
    for span in trace.spans:
        rank = span.attributes.get("parallel.tp_rank")
        label = ("  " * depths[span.span_id]) + (span.stage or span.name) + (f"[{rank}]" if rank else "")
        cells = [
            label,
            f"{(span.start_ns - trace.start_ns) / 1e6:.2f}",
            f"{span.duration_ns / 1e6:.2f}",
            _bar(span.start_ns - trace.start_ns, span.duration_ns, trace.duration_ns, bar_width),
        ]
        if show_status:
            cells.append(_STATUS_TEXT.get(span.status, Text(span.status)))
        cells.append(_digests(span.attributes))
        if show_attributes:
            cells.append(_key_attributes(span.attributes))
        table.add_row(*cells)
    return table


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


def demo_summary(result, command: str = "stagetrace", store_flag: str = "") -> None:
    """What the demo did, what deviated and why, and the next commands to type."""
    console = Console()
    console.print(
        f"served [bold]{result.requests}[/] requests on {len(result.nodes)} nodes ({', '.join(result.nodes)}): "
        f"{result.spans} spans, {result.metric_samples} hardware samples"
    )
    console.print(
        f"deviating outputs: [bold]{len(result.deviating)}[/] (same input, an output other than the majority's)"
    )
    causes: dict[tuple[str, str], list[str]] = {}
    for t in result.truth:
        causes.setdefault((t.stage, t.cause), []).append(t.request_id)
    table = Table(title="injected faults that changed a stage's output (ground truth)", title_justify="left")
    for column in ("stage", "cause", "requests", "e.g."):
        table.add_column(column, no_wrap=True)
    for (stage, cause), ids in sorted(causes.items(), key=lambda kv: -len(kv[1])):
        table.add_row(stage, cause, str(len(ids)), ids[0])
    console.print(table)
    examples = [ids[0] for ids in causes.values()][:3]
    if examples:
        console.print("next, look one up:")
        for request_id in examples:
            console.print(f"  {command} trace {request_id}{store_flag}", highlight=False, soft_wrap=True)
