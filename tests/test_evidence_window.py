"""The verdict's sentence and the incident report's chart tell one story about time, for each kind of hardware cause.

A request deviates on ``node-a`` while a hardware signal changes at a known time against its divergent stage: an
XID series born seconds *before* the stage (the XID's lookback of three scrapes), an RDMA ack-timeout counter
whose step is seen at the first scrape *after* a 30 ms stage (the scrape interval straddles it), and a
thermal-slowdown gauge sampled *while* the stage ran. Neighbours: the same signal changes at the same moment on
``node-b`` (the baseline's host) and, for the NIC, on a device of ``node-a`` the span does not use; ``node-a``'s own
series changes again after the window. Samples are written on a two-second scrape grid in the agent's layout
(counters to ``otel_metrics_sum``, gauges to ``otel_metrics_gauge``), spans through the span exporter
(``tests/fleet.py``).

Checked, with the page's SVG parsed (``xml.etree``) and its drawing mapped back to time through its own axis:
the sentence's interval holds the true time of the change; the chart's marked rise starts and ends where the
sentence's numbers put it; the shaded window is the detector's, computed here from the scrape grid by the rule
in docs/explain.md (lookback scrapes before the last one at or before the stage's start, to the first at or after
its end); the step the line draws lies in the marked rise and rises by what the sentence says, and a later step
of the same series lies outside the window.
"""

from __future__ import annotations

import bisect
import re

import pytest

from stagetrace import lookup
from stagetrace.analysis.explain import Explainer
from stagetrace.exporters.clickhouse import METRIC_COLUMNS
from stagetrace.report import MIN_SHADE_PX, incident_html
from tests import fleet as fl
from tests.charts import SVG, Chart, figures, interval

EVERY = 2 * fl.SECOND  # the scrape grid
MINUTES = 12  # of scrapes, from the fleet's start
DEVIATES_AT = (10, 0.5)  # minutes, seconds: when the deviating request starts


def scrapes(fleet) -> list[int]:
    return list(range(fleet.at(0), fleet.at(MINUTES) + 1, EVERY))


def marker(fleet, host: str) -> None:
    """A counter every host writes at every scrape (its scrape times)."""
    fleet.counter(
        host,
        "gpu_energy_joules_total",
        {"gpu": "0", "uuid": f"GPU-{host}-0"},
        fleet.at(0),
        fleet.at(MINUTES),
        every_ns=EVERY,
        value=1000,
        rises=tuple((t, 50) for t in scrapes(fleet)),
    )


def gauge(fleet, host: str, name: str, labels: dict, values: dict[int, float]) -> None:
    rows = [
        ({"host.name": host}, "stagetrace-agent", "stagetrace.collectors", "", name, "", "", labels, 0, t, float(v))
        for t, v in sorted(values.items())
    ]
    fleet.store.client.insert("otel_metrics_gauge", rows, column_names=METRIC_COLUMNS, database=fleet.store.database)


def first_scrape_at_or_after(fleet, t: int) -> int:
    grid = scrapes(fleet)
    return grid[bisect.bisect_left(grid, t)]


def xid_before(fleet, stage_at: tuple[int, int]) -> tuple[int, int]:
    """An XID series born 5.3 s before decode starts; the same series rises again 20 s after it; node-b's at once."""
    event, later = stage_at[0] - 5_300 * fl.MS, stage_at[1] + 20 * fl.SECOND
    labels = {"gpu": "0", "uuid": "GPU-node-a-0", "xid": "79"}
    born = first_scrape_at_or_after(fleet, event)
    fleet.counter(
        "node-a", "gpu_xid_errors_total", labels, born, fleet.at(MINUTES), every_ns=EVERY, value=1, rises=((later, 1),)
    )
    fleet.counter(
        "node-b",
        "gpu_xid_errors_total",
        {**labels, "uuid": "GPU-node-b-0"},
        born,
        fleet.at(MINUTES),
        every_ns=EVERY,
        value=1,
    )
    return event, 1


def ack_timeout_straddling(fleet, stage_at: tuple[int, int]) -> tuple[int, int]:
    """3 ack timeouts 10 ms into a 30 ms allreduce, seen at the next scrape; neighbours: mlx5_1 on node-a (the span
    names only mlx5_0) and node-b's mlx5_0 at the same moment, and node-a's mlx5_0 again a minute later."""
    event = stage_at[0] + 10 * fl.MS
    name = "rdma_local_ack_timeout_err_total"
    for host, device, rises in (
        ("node-a", "mlx5_0", ((event, 3), (event + 60 * fl.SECOND, 2))),
        ("node-a", "mlx5_1", ((event, 7),)),
        ("node-b", "mlx5_0", ((event, 5),)),
    ):
        fleet.counter(
            host, name, {"device": device, "port": "1"}, fleet.at(0), fleet.at(MINUTES), every_ns=EVERY, rises=rises
        )
    return event, 3


def slowdown_while(fleet, stage_at: tuple[int, int]) -> tuple[int, int]:
    """A thermal slowdown seen at the one scrape inside decode (the grid is shifted so one falls there); node-b's at
    once; node-a's again 30 s later."""
    inside = next(t for t in scrapes(fleet) if stage_at[0] <= t <= stage_at[1])
    for host, active in (("node-a", {inside, inside + 30 * fl.SECOND}), ("node-b", {inside})):
        gauge(
            fleet,
            host,
            "gpu_clock_event_active",
            {"gpu": "0", "uuid": f"GPU-{host}-0", "reason": "hw_thermal_slowdown"},
            {t: 1.0 if t in active else 0.0 for t in scrapes(fleet)},
        )
    return inside, 1


CASES = {
    # name: (divergent stage, metric, device, fault, the scrape lookback the signal weighs, request start shift in ms)
    "xid-before": ("decode", "gpu_xid_errors_total", "GPU-node-a-0", xid_before, 3, 0),
    "ack-timeout-straddling": ("allreduce", "rdma_local_ack_timeout_err_total", "mlx5_0", ack_timeout_straddling, 1, 0),
    "slowdown-while": ("decode", "gpu_clock_event_active", "GPU-node-a-0", slowdown_while, 1, -600),
}


def report_for(store, case: str):
    stage_name, metric, device, fault, lookback, shift_ms = CASES[case]
    fleet = fl.Fleet(store)
    for host in ("node-a", "node-b"):
        marker(fleet, host)
    for i in range(6):  # agreeing requests on both hosts, minutes before the fault
        fleet.request(f"ok-{i}", fleet.at(2 + i % 3, 10 * i), ("node-a", "node-b")[i % 2])
    odd_at = fleet.at(*DEVIATES_AT) + shift_ms * fl.MS
    fleet.request("odd", odd_at, "node-a", differs={stage_name: "corrupt"})
    fleet.flush()
    span = next(s for s in lookup.by_request_id(store, "odd").spans if s.stage == stage_name)
    stage_at = (span.start_ns, span.start_ns + span.duration_ns)
    event, size = fault(fleet, stage_at)
    report = Explainer(store).explain("odd").to_json()
    html = incident_html(store, report)
    return fleet, report, html, stage_at, event, size


@pytest.mark.parametrize("case", CASES)
def test_the_sentence_and_the_chart_cite_the_same_window_and_rise(store, case):
    stage_name, metric, device, _, lookback, _ = CASES[case]
    fleet, report, html, (start, end), event, size = report_for(store, case)
    assert report["first_divergent_stage"] == stage_name
    top = report["causes"][0]
    assert (top["kind"], top["name"], top["device"], top["host"]) == ("hardware", metric, device, "node-a"), top
    assert report["baseline"]["request_id"] != "odd"

    found = re.match(
        rf"{stage_name} diverged: {metric} (?:rose by|was) (\S+) (.+?) on {device} \(node-a\), "
        r"not for the baseline",
        report["summary"],
    )
    assert found, report["summary"]
    cited, words = float(found[1]), found[2]
    assert cited == size
    said = interval(words, stage_name, start, end)
    assert said[0] <= event <= said[1], (words, "the words hold the time the change happened")
    assert {"xid-before": "in the", "ack-timeout-straddling": "between", "slowdown-while": "while"}[case] in words

    [svg] = [
        svg
        for svg, caption in figures(html)
        if f'aria-label="{metric}"' in svg and device in caption and "node-a" in caption
    ]
    chart = Chart(svg)
    px = chart.ns_per_px
    rounding = 100 * fl.MS  # the sentence's tenths of a second, rounded outwards

    # the shaded window is the detector's: by the rule, from the scrape grid
    grid = scrapes(fleet)
    first = grid[bisect.bisect_right(grid, start) - 1 - lookback]
    last = grid[bisect.bisect_left(grid, end)]
    drawn = chart.band("window")
    assert abs(drawn[0] - first) <= px and abs(drawn[1] - last) <= px, (drawn, (first, last))

    # the stage, outlined where it ran (widened when narrower than MIN_SHADE_PX), its outline inside the shaded
    # window: widened about its middle, a stage near the window's end stuck out past it
    stage = chart.band("stage")
    assert stage[0] <= start + px and end - px <= stage[1], (stage, (start, end))
    (window_left, window_right), (stage_left, stage_right) = chart.drawn("window"), chart.drawn("stage")
    assert window_left <= stage_left and stage_right <= window_right, (
        (window_left, window_right),
        (stage_left, stage_right),
    )
    # the marked rise starts and ends where the sentence's numbers put it
    rise = chart.band("rise")
    widened = MIN_SHADE_PX * px / 2
    if words.startswith(("in the", "between")):
        assert abs(rise[0] - said[0]) <= rounding + px, (rise, said)
    if words.startswith(("between", "in the")) and "after" in words:
        assert abs(rise[1] - said[1]) <= rounding + px, (rise, said)
    if words.startswith("in the") and "before" in words:
        assert rise[1] <= start + px
    if words.startswith("while"):
        assert stage[0] - widened - px <= rise[0] and rise[1] <= stage[1] + widened + px
    assert drawn[0] - px <= rise[0] and rise[1] <= drawn[1] + px, "the rise lies in the window weighed"

    # the line: the cited change is drawn inside the marked rise, by as much as the sentence says
    if top["value"].startswith("+"):  # a counter: a step up of the cited size
        steps = chart.steps_up()
        inside = [(t, h) for t, h in steps if rise[0] - px <= t <= rise[1] + px]
        assert len(inside) == 1 and inside[0][1] == pytest.approx(cited, rel=0.02), (steps, rise)
        outside = [t for t, _ in steps if not drawn[0] - px <= t <= drawn[1] + px]
        assert len(outside) == len(steps) - 1, "the series' later step is drawn outside the window"
    else:  # a gauge: its value at the marked time is the one cited
        at = [(chart.time(x), chart.value(y)) for x, y in chart.points()]
        assert any(
            rise[0] - widened - px <= t <= rise[1] + widened + px and v == pytest.approx(cited, rel=0.02) for t, v in at
        ), at
        assert any(v == pytest.approx(cited, rel=0.02) and not drawn[0] - px <= t <= drawn[1] + px for t, v in at)


@pytest.mark.parametrize("window_s", [0.004, 2.0, 6.0])  # narrower than MIN_SHADE_PX, a scrape, three scrapes
@pytest.mark.parametrize("where", ["at the start", "in the middle", "at the end"])
def test_the_stage_outline_stays_inside_the_shaded_window(window_s, where):
    """A 30 ms stage in a two-minute chart is widened to MIN_SHADE_PX about its middle; at the window's edge (the
    stage ends at the scrape that closes the window) half of it, and its outline, stuck out past the shading. Drawn
    inside the window wherever the stage lies in it, and still over the stage's times; the window weighed drawn
    where it is."""
    from stagetrace.report import series_svg

    second = 10**9
    frame = (0, 120 * second)
    window = (60 * second, 60 * second + round(window_s * second))
    stage_ns = min(30 * 10**6, window[1] - window[0])
    begins = {
        "at the start": window[0],
        "in the middle": (window[0] + window[1] - stage_ns) // 2,
        "at the end": window[1] - stage_ns,
    }[where]
    stage = (begins, begins + stage_ns)
    times = list(range(0, frame[1] + 1, 2 * second))
    chart = Chart(
        series_svg(
            times,
            [float(t >= 61 * second) for t in times],
            window,
            "gpu_xid_errors_total",
            frame=frame,
            counter=True,
            stage=stage,
        )
    )
    px = chart.ns_per_px
    (window_left, window_right), (stage_left, stage_right) = chart.drawn("window"), chart.drawn("stage")
    assert window_left <= stage_left and stage_right <= window_right, (
        (window_left, window_right),
        (stage_left, stage_right),
    )
    assert float(chart.root.find(f"{SVG}rect[@class='stage']").get("width")) >= MIN_SHADE_PX
    drawn, outlined = chart.band("window"), chart.band("stage")
    assert drawn[0] - px <= window[0] and window[1] <= drawn[1] + px
    assert outlined[0] <= stage[0] + px and stage[1] - px <= outlined[1], (outlined, stage)
