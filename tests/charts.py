"""Reading the incident report's charts as drawn, and the verdict's words about time, for the tests that compare them.

A chart is an ``<svg>`` parsed with ``xml.etree``; x positions map back to time through its own axis line and its
``data-t0``/``data-t1`` (the times at the axis' ends), y positions to values through its value axis' labels.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

SVG = "{http://www.w3.org/2000/svg}"
UNIT = {"s": 1_000_000_000, "ms": 1_000_000}


def interval(words: str, stage: str, start: int, end: int) -> tuple[int, int]:
    """The times the sentence's words allow for the change, against the stage's start and end."""

    def edge(text: str) -> int:
        number, unit, side, which = re.fullmatch(
            rf"([\d.]+) (m?s) (before|after) (?:{stage}|it) (started|ended)", text
        ).groups()
        offset = round(float(number) * UNIT[unit]) * (-1 if side == "before" else 1)
        return (start if which == "started" else end) + offset

    if words == f"while {stage} ran":
        return start, end
    if found := re.fullmatch(rf"in the ([\d.]+ m?s) before {stage} started", words):
        return edge(f"{found[1]} before {stage} started"), start
    if found := re.fullmatch(rf"in the ([\d.]+ m?s) after {stage} ended", words):
        return end, edge(f"{found[1]} after {stage} ended")
    found = re.fullmatch(r"between (.+) and (.+)", words)
    assert found, words
    return edge(found[1]), edge(found[2])


class Chart:
    """One ``<svg>`` of the report, read as drawn: x positions mapped back to time through its axis line."""

    def __init__(self, svg: str):
        self.root = ET.fromstring(svg)
        axis = self.root.find(f"{SVG}line[@class='axis']")
        self.x0, self.x1 = float(axis.get("x1")), float(axis.get("x2"))
        self.t0, self.t1 = int(self.root.get("data-t0")), int(self.root.get("data-t1"))
        self.ns_per_px = (self.t1 - self.t0) / (self.x1 - self.x0)
        plot = [line for line in self.root.iter(f"{SVG}line") if line.get("x1") == line.get("x2")][0]
        self.y_top, self.y_bottom = float(plot.get("y1")), float(plot.get("y2"))
        # the value axis' two labels, left of it (a counter's as "+N": its increase since the frame's start)
        ends = sorted(float(t.text.lstrip("+")) for t in self.root.iter(f"{SVG}text") if float(t.get("x")) < self.x0)
        assert len(ends) == 2, ends
        self.v0, self.v1 = ends

    def time(self, x: float) -> int:
        return round(self.t0 + (x - self.x0) * self.ns_per_px)

    def value(self, y: float) -> float:
        return self.v0 + (self.y_bottom - y) / (self.y_bottom - self.y_top) * (self.v1 - self.v0)

    def band(self, name: str) -> tuple[int, int]:
        rect = self.root.find(f"{SVG}rect[@class='{name}']")
        assert rect is not None, name
        x, w = float(rect.get("x")), float(rect.get("width"))
        return self.time(x), self.time(x + w)

    def drawn(self, name: str) -> tuple[float, float]:
        """The left and right x a band's ink reaches, its outline included (a stroke straddles the rect's edge)."""
        rect = self.root.find(f"{SVG}rect[@class='{name}']")
        assert rect is not None, name
        x, w = float(rect.get("x")), float(rect.get("width"))
        half = float(rect.get("stroke-width", "1")) / 2 if rect.get("stroke") else 0.0
        return x - half, x + w + half

    def points(self) -> list[tuple[float, float]]:
        line = self.root.find(f"{SVG}polyline[@class='series']")
        return [tuple(map(float, p.split(","))) for p in line.get("points").split()]

    def steps_up(self) -> list[tuple[int, float]]:
        """(time, height in the series' unit) of each vertical segment that goes up."""
        points = self.points()
        return [
            (self.time(x), self.value(y) - self.value(y_before))
            for (x_before, y_before), (x, y) in zip(points, points[1:])
            if x == x_before and y < y_before
        ]


def figures(html: str) -> list[tuple[str, str]]:
    """(svg, caption) of each chart of a report's counters section."""
    return re.findall(r'<figure class="counter">(<svg .*?</svg>)<figcaption>(.*?)</figcaption>', html, flags=re.S)
