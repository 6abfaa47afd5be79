"""``stagetrace explain REQUEST_ID --html FILE``: one self-contained HTML page to attach to an incident ticket.

It holds what ``explain`` concluded and what it saw: the verdict, the request's and the baseline's waterfalls
side by side with the divergent stage marked, the stage-by-stage digest comparison, the ranked causes with
their evidence, and for each hardware cause the counter's samples around the stage, drawn from the cause's
``Timing`` (the record the verdict's sentence reads too): the window its detector weighed shaded, the stage
outlined, the rise marked (for a co-tenant, that tenant's use of the GPU, its stage shaded), beside the GPM
activity of the divergent stage's GPU where the store holds GPM samples of it (a GPU without them, as the
demo's, gets no activity chart).
Everything is inline (CSS, SVG): the page fetches nothing, runs no script, and prints as it shows.
IDs are in ``<code>`` elements that never wrap and select whole with one click.
"""

from __future__ import annotations

import re
import time
from html import escape

from stagetrace import lookup
from stagetrace.analysis.activity import NAMES as ACTIVITY_NAMES
from stagetrace.analysis.activity import Activity
from stagetrace.analysis.causes import Cause
from stagetrace.analysis.hardware import Samples, Timing, devices
from stagetrace.analysis.results import Explanation
from stagetrace.analysis.tenants import Tenancy
from stagetrace.render import cause_groups, evidence
from stagetrace.store import Store

CAUSES_SHOWN = 8
FRAME_MARGIN_NS = 30 * 10**9  # every chart of a report spans the charted stages and this either side: a few scrapes
MIN_SHADE_PX = 8.0  # a stage of milliseconds in a minute-wide chart is still seen
STAGE_OUTLINE_PX = 1.0
ACTIVITY_GPUS = 2  # a TP stage's GPUs beyond these add charts, not understanding
_STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px;color:#1d232b;max-width:1400px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 8px;border-bottom:1px solid #d5dae0}
code{font:13px ui-monospace,Menlo,Consolas,monospace;white-space:nowrap;user-select:all;background:#f1f3f5;
padding:0 3px;border-radius:3px}
.verdict{font-weight:600;padding:2px 8px;border-radius:4px;color:#fff}.diverged{background:#c92a2a}
.agrees{background:#2b8a3e}.summary{font-weight:600;margin:10px 0}
.pair{display:grid;grid-template-columns:1fr 1fr;gap:16px}.pair>div{min-width:0}
table{border-collapse:collapse;margin:4px 0;max-width:100%}th,td{border:1px solid #d5dae0;padding:3px 8px;
text-align:left;vertical-align:top}th{background:#f1f3f5}td.num{text-align:right}tr.marked td{background:#fff0f0}
.causes{width:100%}.causes td{overflow-wrap:break-word}.causes td.num{white-space:nowrap}
.list code{display:inline-block}.shortened{cursor:help}.vs{color:#5c6670;margin-top:2px}
.differs{color:#c92a2a;font-weight:600}svg{display:block;max-width:100%;height:auto}
svg text{font:11px ui-monospace,Menlo,Consolas,monospace;fill:#1d232b}
@media print{body{margin:0}.pair{grid-template-columns:1fr}h2{break-after:avoid}section{break-inside:avoid}}
"""


def _code(text: str) -> str:
    return f"<code>{escape(text)}</code>"


def _span_label(span: lookup.Span) -> str:
    return (span.stage or span.name) + (f"[{span.rank}]" if span.rank else "")


def waterfall_svg(trace: lookup.Trace, marked_stage: str | None, width: int = 640) -> str:
    """One trace's spans as bars on a shared time axis; the spans of ``marked_stage`` in red and labelled."""
    row, label_w, top = 18, 170, 20
    plot_w = width - label_w - 60
    total = max(trace.duration_ns, 1)
    height = top + row * len(trace.spans) + 8
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" role="img" aria-label="waterfall of trace {escape(trace.trace_id)}">',
        f'<text x="{label_w}" y="12">0 ms</text>'
        f'<text x="{label_w + plot_w}" y="12" text-anchor="end">{trace.duration_ns / 1e6:.2f} ms</text>',
    ]
    for i, span in enumerate(trace.spans):
        y = top + i * row
        marked = bool(marked_stage) and span.stage == marked_stage
        x = label_w + (span.start_ns - trace.start_ns) / total * plot_w
        w = max(2.0, span.duration_ns / total * plot_w)
        colour = "#c92a2a" if marked else "#1c7ed6"
        if marked:
            parts.append(f'<rect class="marked-row" x="0" y="{y - 2}" width="{width}" height="{row}" fill="#fff0f0"/>')
        parts.append(
            f'<text x="4" y="{y + 11}">{escape(_span_label(span))}</text>'
            f'<rect class="bar{" marked" if marked else ""}" data-stage="{escape(span.stage or "")}" '
            f'x="{x:.1f}" y="{y + 2}" width="{w:.1f}" height="{row - 6}" fill="{colour}"/>'
            f'<text x="{x + w + 4:.1f}" y="{y + 11}">{span.duration_ns / 1e6:.2f}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def series_svg(
    times: list[int],
    values: list[float],
    window: tuple[int, int],
    title: str,
    width: int = 640,
    frame: tuple[int, int] | None = None,
    counter: bool = False,
    stage: tuple[int, int] | None = None,
    rise: tuple[int, int] | None = None,
) -> str:
    """A series' samples as a step line over ``frame`` (default: the samples and the window), ``window`` shaded.

    For a hardware cause ``window`` is the window its detector weighed, ``stage`` the stage's own span (outlined
    inside it) and ``rise`` when the change happened (``Timing``: a band from the scrape before the step to the
    step): the times the verdict's sentence cites, drawn where they are on the time axis. A band narrower than
    ``MIN_SHADE_PX`` is widened about its middle (a stage of milliseconds in a minute-wide chart is still seen);
    the stage and the rise are kept inside the window as drawn (moved in, or cut to it), the stage's outline too.
    A ``counter`` is drawn as its increase since the frame's start, from 0 where its series begins inside the frame
    (born at its first event, as the hardware signals count it), so a rise of 1 on a counter of millions still
    shows. Every band carries its times (``data-from-ns``, ``data-to-ns``); ``data-t0``/``data-t1`` are the
    times at the ends of the axis line."""
    height, left, right, top, bottom = 170, 60, 16, 22, 30
    if frame is None:
        frame = (min([*times, window[0]]), max([*times, window[1]]))
    times, values = _framed(times, values, frame, counter)
    (t0, t1), unit = frame, "+" if counter else ""
    v0, v1 = min([*values, 0.0]), max(values, default=1.0)
    span_t, span_v = max(t1 - t0, 1), (v1 - v0) or 1.0
    plot_w, plot_h = width - left - right, height - top - bottom

    def x(t: int) -> float:
        return left + (t - t0) / span_t * plot_w

    def y(v: float) -> float:
        return top + plot_h - (v - v0) / span_v * plot_h

    def band(
        name: str,
        times: tuple[int, int],
        style: str,
        within: tuple[float, float] | None = None,
        tall: float = 1.0,
        least: float = MIN_SHADE_PX,
    ) -> tuple[str, float, float]:
        """The band's ``<rect>`` and its drawn left and right x, at least ``least`` wide; ``within`` (x, default
        the plot) bounds it: a widened band is moved inside, and one wider than ``within`` is cut to it."""
        lo, hi = within or (left, left + plot_w)
        w = min(max(least, x(times[1]) - x(times[0])), hi - lo)
        bx = min(max((x(times[0]) + x(times[1]) - w) / 2, lo), hi - w)
        return (
            f'<rect class="{name}" data-from-ns="{times[0]}" data-to-ns="{times[1]}" x="{bx:.1f}" y="{top}" '
            f'width="{w:.1f}" height="{plot_h * tall:.1f}" {style}/>',
            bx,
            bx + w,
        )

    points = []
    for i, (t, v) in enumerate(zip(times, values)):
        if i:
            points.append(f"{x(t):.1f},{y(values[i - 1]):.1f}")  # a sample holds until the next scrape
        points.append(f"{x(t):.1f},{y(v):.1f}")
    # room for a stage of the least width and its outline inside
    bands, window_lo, window_hi = band("window", window, 'fill="#ffe3e3"', least=MIN_SHADE_PX + STAGE_OUTLINE_PX)
    if stage is not None:
        # inside the shaded window as drawn, its 1 px outline included (a stroke straddles the rect's edge): a
        # stage widened about its middle near the window's end stuck out past it
        inset = STAGE_OUTLINE_PX / 2
        bands += band(
            "stage",
            stage,
            f'fill="#ffc9c9" stroke="#c92a2a" stroke-width="{STAGE_OUTLINE_PX:g}" stroke-dasharray="3 2"',
            within=(window_lo + inset, window_hi - inset),
        )[0]
    if rise is not None:
        # a strip along the top: a rise that spans the window leaves the window's shading and the line in view
        bands += band("rise", rise, 'fill="#f08c00" fill-opacity="0.8"', within=(window_lo, window_hi), tall=0.12)[0]
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" role="img" aria-label="{escape(title)}" data-t0="{t0}" data-t1="{t1}">'
        f'<text x="{left}" y="14">{escape(title)}{" (increase)" if counter else ""}</text>{bands}'
        f'<line class="axis" x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" '
        'stroke="#868e96"/>'
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#868e96"/>'
        f'<text x="{left - 4}" y="{top + 8}" text-anchor="end">{unit}{v1:g}</text>'
        f'<text x="{left - 4}" y="{top + plot_h}" text-anchor="end">{v0:g}</text>'
        f'<text x="{left}" y="{height - 8}">{escape(lookup.iso_ns(t0)[11:19])} UTC</text>'
        f'<text x="{left + plot_w}" y="{height - 8}" text-anchor="end">{escape(lookup.iso_ns(t1)[11:19])} UTC</text>'
        f'<polyline class="series" points="{" ".join(points)}" fill="none" stroke="#1c7ed6" stroke-width="2"/>'
        "</svg>"
    )


def _framed(times: list[int], values: list[float], frame: tuple[int, int], counter: bool):
    """The samples within ``frame``, held from the frame's start (the last value before it, or, for a counter
    whose series begins inside it, 0) to its end; a counter's as increases from the frame's start."""
    before = [v for t, v in zip(times, values) if t < frame[0]]
    inside = [(t, v) for t, v in zip(times, values) if frame[0] <= t <= frame[1]]
    if before:
        inside.insert(0, (frame[0], before[-1]))
    elif counter and inside and inside[0][0] > frame[0]:
        inside.insert(0, (frame[0], 0.0))
    if inside and inside[-1][0] < frame[1]:
        inside.append((frame[1], inside[-1][1]))
    if counter and inside:
        first = inside[0][1]
        inside = [(t, v - first) for t, v in inside]
    return [t for t, _ in inside], [v for _, v in inside]


LONG_VALUE = 40  # characters of a value without separators shown whole; a longer one is shortened, whole on hover
_SEPARATED = re.compile(r"[^,;\s]+[,;]?")


def _value(text: str) -> str:
    """A cause's value: an ID-like one (no spaces: a GPU UUID, a version) whole in ``<code>``. A list (``gpu.uuids``:
    UUIDs joined by commas) is one ``<code>`` per item, so the cell wraps between items and never inside one: a
    list in one unbreakable element pushed the baseline, score and evidence columns off the page. A single word
    longer than ``LONG_VALUE`` (no separator to wrap at) shows its start and end, and whole on hover."""
    if not text:
        return "(unset)"
    if " " in text:
        return f'<span class="prose">{escape(text)}</span>'
    items = _SEPARATED.findall(text)
    if "".join(items) == text and len(items) > 1:
        return '<span class="list">' + "<wbr>".join(_code(item) for item in items) + "</span>"
    if len(text) > LONG_VALUE:
        half = (LONG_VALUE - 1) // 2
        return f'<code class="shortened" title="{escape(text)}">{escape(text[:half])}…{escape(text[-half:])}</code>'
    return _code(text)


def _figure(
    times: list[int],
    values: list[float],
    window: tuple[int, int],
    frame: tuple[int, int],
    name: str,
    caption: str,
    counter: bool = False,
    timing: Timing | None = None,
) -> str:
    if timing is not None:  # a hardware cause: the detector's window, the stage inside it, and the rise
        window, stage, rise = timing.window_ns, timing.stage_ns, timing.rise_ns
    else:
        stage = rise = None
    chart = series_svg(times, values, window, name, frame=frame, counter=counter, stage=stage, rise=rise)
    return f'<figure class="counter">{chart}<figcaption>{caption}</figcaption></figure>'


def _stage_window(trace: lookup.Trace, stage: str | None, rank: str = "") -> tuple[int, int] | None:
    spans = [s for s in trace.spans if stage and s.stage == stage and (not rank or s.rank == rank)]
    if not spans:
        return None
    return min(s.start_ns for s in spans), max(s.start_ns + s.duration_ns for s in spans)


def _frame(trace: lookup.Trace, stage: str | None, causes: list[Cause]) -> tuple[int, int]:
    """One span of time for every chart of the report: the stages they shade, ``FRAME_MARGIN_NS`` either side."""
    hardware = [c for c in causes if c.kind == "hardware"]
    windows = [
        w
        for w in [_stage_window(trace, stage)]
        + [_stage_window(trace, c.stage, c.evidence.get("rank") or "") for c in hardware]
        if w
    ]
    windows += [timing.window_ns for c in hardware if (timing := Timing.of(c.evidence))]  # a lookback reaches further
    start = min((w[0] for w in windows), default=trace.start_ns)
    end = max((w[1] for w in windows), default=trace.start_ns + trace.duration_ns)
    return start - FRAME_MARGIN_NS, end + FRAME_MARGIN_NS


def _activity_charts(store: Store, trace: lookup.Trace, stage: str | None, frame: tuple[int, int]) -> list[str]:
    """The GPM activity of the divergent stage's GPUs (the first ``ACTIVITY_GPUS``) over the report's frame."""
    spans = [s for s in trace.spans if stage and s.stage == stage]
    gpus = list(dict.fromkeys((s.resource.get("host.name", ""), u) for s in spans for u in devices(s.attributes)[0]))
    if not gpus:
        return []
    window = _stage_window(trace, stage)
    found = Activity(store, gpus[:ACTIVITY_GPUS], *frame)
    charts = []
    for host, uuid in gpus[:ACTIVITY_GPUS]:
        for name in ACTIVITY_NAMES:
            times, values = found.series(host, uuid, name)
            if times:
                charts.append(
                    _figure(
                        times,
                        values,
                        window,
                        frame,
                        name,
                        f"{escape(name)} on {_code(uuid)} "
                        f"({escape(host)}) while {escape(stage)} ran (shaded): GPM activity",
                    )
                )
    return charts


def _tenant_chart(store: Store, cause: Cause, window: tuple[int, int], frame: tuple[int, int]) -> str:
    """A co-tenant cause: that tenant's series on the GPU over the report's frame."""
    ev = cause.evidence
    labels = ev["labels"]
    tenancy = Tenancy(store, [(ev["host"], ev["device"])], *frame)
    times, values = tenancy.series(ev["host"], ev["device"], cause.name, labels["namespace"], labels["pod"])
    if not times:
        return ""
    return _figure(
        times,
        values,
        window,
        frame,
        cause.name,
        f"{escape(cause.name)} of {escape(ev['tenant'])} on {_code(ev['device'])} "
        f"({escape(ev['host'])}) while {escape(cause.stage)} ran (shaded)",
    )


def _counter_charts(store: Store, trace: lookup.Trace, causes: list[Cause], frame: tuple[int, int]) -> list[str]:
    """For each hardware cause: its series on its device over the report's frame (a counter as its increase)."""
    charts = []
    for cause in causes:
        if cause.kind != "hardware":
            continue
        ev = cause.evidence
        window = _stage_window(trace, cause.stage, ev.get("rank") or "")
        if window is None:
            continue
        if ev.get("tenant"):
            charts += [chart for chart in [_tenant_chart(store, cause, window, frame)] if chart]
            continue
        samples = Samples(store, [ev["host"]], *frame)
        for name, series in samples.series(ev["host"], ev["device"]):
            if name != cause.name or series.labels != ev.get("labels", series.labels):
                continue
            timing = Timing.of(ev)
            rank = escape(f"rank {ev['rank']}, ") if ev.get("rank") else ""  # two ranks may share a NIC
            when = (
                f"{timing.words(cause.stage)} (marked); the window weighed shaded, {cause.stage} outlined"
                if timing
                else f"while {cause.stage} ran (shaded)"
            )
            charts.append(
                _figure(
                    series.times,
                    series.values,
                    window,
                    frame,
                    name,
                    f"{escape(name)} on {rank}{_code(ev['device'])} ({escape(ev['host'])}): "
                    f"{escape(cause.value)} {escape(when)}",
                    counter=not series.signal.is_gauge,
                    timing=timing,
                )
            )
    return charts


def incident_html(store: Store, report: Explanation | dict, made_ns: int | None = None) -> str:
    """The page for ``report`` (``Explainer.explain``'s, or its JSON read back), reading the traces and counters it
    needs from ``store``; ``made_ns``, the time its footer says it was made (default now)."""
    if isinstance(report, dict):
        report = Explanation.from_json(report)
    trace = lookup.by_trace_id(store, report.trace_id)
    baseline = report.baseline
    baseline_trace = lookup.by_request_id(store, baseline.request_id) if baseline else None
    stage = report.first_divergent_stage
    causes = report.causes[:CAUSES_SHOWN]
    verdict = "diverged" if report.diverged else "agrees"
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>stagetrace: request {escape(report.request_id)} {verdict}</title>",
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
        'img-src data:">',
        f"<style>{_STYLE}</style></head><body>",
        f'<h1>Request {_code(report.request_id)} <span class="verdict {verdict}" id="verdict">{verdict}</span></h1>',
        f"<div>trace {_code(report.trace_id)}</div>",
    ]
    if baseline:
        out.append(
            f"<div>baseline request {_code(baseline.request_id)} ({escape(baseline.how)}, "
            f"{baseline.support} of {baseline.group_size} requests with this input)</div>"
        )
    out.append(f'<p class="summary" id="summary">{escape(report.summary)}</p>')
    out.append('<section><h2>Waterfalls</h2><div class="pair">')
    out.append(f'<div id="waterfall-request"><h3>this request</h3>{waterfall_svg(trace, stage)}</div>')
    if baseline_trace is not None:
        out.append(f'<div id="waterfall-baseline"><h3>baseline</h3>{waterfall_svg(baseline_trace, stage)}</div>')
    out.append("</div></section>")
    if report.stages:
        out.append(
            '<section><h2>Stages against the baseline</h2><table id="stages"><tr><th>stage</th><th>input</th>'
            "<th>output</th></tr>"
        )
        for row in report.stages:
            name = row.stage + (f"[{row.rank}]" if row.rank else "")
            cells = (
                ("missing", "missing")
                if not row.present
                else tuple("same" if same else "differs" for same in (row.input_matches, row.output_matches))
            )
            marked = ' class="marked"' if row.stage == stage else ""
            out.append(
                f"<tr{marked}><td>{escape(name)}</td>" + "".join(f'<td class="{c}">{c}</td>' for c in cells) + "</tr>"
            )
        out.append("</table></section>")
    for n, (title, group) in enumerate(cause_groups(causes)):
        # the value above the baseline's, in one column: two columns as wide as a GPU UUID each, beside a cause's
        # name and an evidence that names a device, were wider than a 1280 px window
        out.append(
            f'<section><h2>{escape(title[0].upper() + title[1:])}</h2><table id="{"causes" if n == 0 else "weak"}"'
            ' class="causes"><tr><th>#</th><th>cause</th><th>kind</th>'
            "<th>value<div class=vs>the baseline's</div></th><th>score</th><th>evidence</th></tr>"
        )
        for i, cause in enumerate(group, 1):
            out.append(
                f"<tr><td class=num>{i}</td><td>{_code(cause.name)}</td><td>{escape(cause.kind)}</td>"
                f"<td>{_value(cause.value)}<div class=vs>baseline: {_value(cause.baseline_value)}</div>"
                f"</td><td class=num>{cause.recorded_score:.2f}</td><td>{evidence(cause, escape, _code)}</td></tr>"
            )
        out.append("</table></section>")
    frame = _frame(trace, stage, causes)
    charts = _counter_charts(store, trace, causes, frame) + _activity_charts(store, trace, stage, frame)
    if charts:
        out.append('<section id="counters"><h2>Counters around the stage</h2>' + "".join(charts) + "</section>")
    made = lookup.iso_ns(time.time_ns() if made_ns is None else made_ns)[:19].replace("T", " ")
    started = lookup.iso_ns(trace.start_ns)[:19].replace("T", " ")
    out.append(
        f"<footer><p>Made by stagetrace explain at {made} UTC for request {_code(report.request_id)}, "
        f"which started at {started} UTC.</p></footer>"
    )
    out.append("</body></html>")
    return "\n".join(out)


__all__ = ["incident_html", "series_svg", "waterfall_svg"]
