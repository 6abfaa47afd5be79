"""Terminal rendering (rich): a trace as a waterfall, the demo's progress and summary."""

from __future__ import annotations

from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from stagetrace import conventions
from stagetrace.lookup import ENGINE_LATENCY_PREFIX, Span, Trace

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
_ENGINE_LABELS = {"time_in_queue": "queue", "time_to_first_token": "ttft", "time_in_model_prefill": "prefill",
                  "time_in_model_decode": "decode", "time_in_model_inference": "inference", "e2e": "e2e"}  # fmt: skip


def engine_timings(span: Span) -> str:
    """``queue 12.0 · ttft 85.3 · prefill 80.1 · decode 1203.4 ms`` for an engine's request span, else ''."""
    timings = span.engine_ms
    order = [k for k in _ENGINE_LABELS if k in timings] + sorted(k for k in timings if k not in _ENGINE_LABELS)
    text = " · ".join(f"{_ENGINE_LABELS.get(k, k)} {timings[k]:.1f}" for k in order)
    return f"{text} ms" if text else ""


def _key_attributes(attrs: dict[str, str]) -> str:
    # content (prompts, documents) and digests are not shown: the digests column stands for them
    shown = [(k, v) for k, v in attrs.items() if not conventions.is_content(k) and k not in conventions.DIGEST_KEYS
             and k not in conventions.REQUEST_ID_ALIASES and not k.startswith(("stagetrace.", ENGINE_LATENCY_PREFIX))]  # fmt: skip
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
    # engine timings below the table, so they show however narrow the terminal is
    engines = [f"{span.name} ({span.service}): {engine_timings(span)}" for span in trace.spans if span.engine_ms]
    caption = "\n".join(engines) or None
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left", expand=False,
                  pad_edge=False)  # fmt: skip
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
        rank = span.rank
        label = ("  " * depths[span.span_id]) + (span.stage or span.name) + (f"[{rank}]" if rank else "")
        cells = [
            label,
            f"{(span.start_ns - trace.start_ns) / 1e6:.2f}",
            f"{span.duration_ns / 1e6:.2f}",
            _bar(span.start_ns - trace.start_ns, span.duration_ns, trace.duration_ns, bar_width),
        ]
        if show_status:
            cells.append(_STATUS_TEXT.get(span.status, Text(span.status)))
        cells.append(_digests(span, trace))
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
        console.print("next, look one up and ask why it deviates:")
        for request_id in examples:
            for verb in ("trace", "explain"):
                console.print(f"  {command} {verb} {request_id}{store_flag}", highlight=False, soft_wrap=True)
        console.print(f"  {command} divergences{store_flag}", highlight=False, soft_wrap=True)


def _cause_row(cause: dict) -> list[str]:
    evidence = cause.get("device") or ""
    if "requests_with_value" in cause:
        evidence = (f"{cause['diverged_with_value']}/{cause['requests_with_value']} with this value diverged here, "
                    f"{cause['diverged_with_baseline_value']}/{cause['requests_with_baseline_value']} with the baseline's")
    elif cause["kind"] == "hardware":
        rank = f"rank {cause['rank']}: " if cause.get("rank") else ""
        evidence = f"{rank}on {cause['device']} ({cause['host']})"
    elif cause["kind"] == "rollout":
        evidence = cause["rollout"]["summary"]
    elif cause["kind"] == "nondeterminism":
        evidence = cause["reason"]
    kind = cause["kind"] + (" (weak)" if cause.get("weak") else "")
    return [kind, cause["name"], cause["value"] or "(unset)", cause["baseline_value"] or "(unset)",
            f"{cause['score']:.2f}", evidence]  # fmt: skip


def explanation(report: dict, causes_shown: int = 8) -> None:
    """``stagetrace explain``: the verdict, the stage comparison, the ranked causes."""
    console = Console()
    verdict = "[bold red]diverged[/]" if report["diverged"] else "[bold green]agrees[/]"
    console.print(f"request {report['request_id']} · trace {report['trace_id']} · {verdict}")
    console.print(report["summary"], style="bold", highlight=False)
    if report.get("stages"):
        table = Table(title="stages against the baseline", title_justify="left")
        for column in ("stage", "input", "output"):
            table.add_column(column, no_wrap=True)
        for stage in report["stages"]:
            name = stage["stage"] + (f"[{stage['rank']}]" if stage["rank"] else "")
            if not stage["present"]:
                table.add_row(name, "missing", "missing", style="red")
                continue
            table.add_row(name, "same" if stage["input_matches"] else "[red]differs[/]",
                          "same" if stage["output_matches"] else "[red]differs[/]")  # fmt: skip
        console.print(table)
    if report.get("causes"):
        table = Table(title="causes, best first", title_justify="left")
        for column in ("kind", "name", "value", "baseline", "score", "evidence"):
            table.add_column(column, overflow="fold")
        for cause in report["causes"][:causes_shown]:
            table.add_row(*_cause_row(cause))
        console.print(table)


def divergence_groups(found: dict, since: str) -> None:
    """``stagetrace divergences``: deviating requests by input group, with their first divergent stage and top cause."""
    console = Console()
    console.print(f"{found['deviating']} deviating requests in the last {since}"
                  + (f"; the latest {found['analysed']} analysed" if found["analysed"] < found["deviating"] else "")
                  + (f"; {found['nondeterministic']} sampled without a seed, not compared" if found.get("nondeterministic") else ""))
    for rollout in found.get("rollouts", ()):
        console.print(f"rollout: {rollout['summary']}", highlight=False, soft_wrap=True)
    table = Table(title_justify="left")
    for column in ("input", "majority", "request", "stage", "top cause", "value vs baseline"):
        table.add_column(column, overflow="fold")
    for group in found["groups"]:
        for i, item in enumerate(group["deviating"]):
            top = item["top_cause"] or {}
            table.add_row(group["input_digest"][:8] if i == 0 else "", f"{group['support']}/{group['requests']}" if i == 0 else "",
                          item["request_id"], item["first_divergent_stage"] or "after the last stage", top.get("name", "-"),
                          f"{top.get('value', '')} vs {top.get('baseline_value', '')}" if top else "")  # fmt: skip
    if found["groups"]:
        console.print(table)


def hardware_rises(rises: list[dict]) -> Table:
    """Error counters that rose on the request's GPUs and NICs while its stages ran."""
    table = Table(title="hardware while it ran: error counters that rose", title_justify="left")
    for column in ("stage", "host", "device", "counter", "labels", "increase"):
        table.add_column(column, overflow="fold")
    for rise in rises:
        labels = " ".join(f"{k}={v}" for k, v in rise["labels"].items() if k not in ("uuid", "device", "gpu", "model"))
        table.add_row(rise["stage"] or "", rise["host"], rise["device"], rise["metric"], labels, f"+{rise['increase']:g}",
                      style="red")  # fmt: skip
    return table
