"""Small builders for Grafana dashboard JSON: ClickHouse targets, panels, template variables, layout.

Every panel builder takes a unit, so no panel leaves Grafana to guess one. Panels are laid out
left to right in a 24-column grid by :func:`dashboard`, which also numbers them.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Sequence

DATASOURCE_TYPE = "grafana-clickhouse-datasource"
DATASOURCE_UID = "stagetrace-clickhouse"  # the provisioned data source; the datasource variable defaults to it
DATASOURCE_NAME = "stagetrace ClickHouse"
DATASOURCE = {"type": DATASOURCE_TYPE, "uid": "${datasource}"}
SCHEMA_VERSION = 39  # what the plugin's own bundled dashboards use; Grafana migrates it forward on load
TAG = "stagetrace"
TRACE_LOOKUP_UID = "stagetrace-trace-lookup"

# A ClickHouse target's format (the plugin's src/data/utils.ts) and the query type that goes with it.
TIME_SERIES, TABLE, LOGS, TRACES = 0, 1, 2, 3
_QUERY_TYPE = {TIME_SERIES: "timeseries", TABLE: "table", LOGS: "logs", TRACES: "traces"}


def sql_text(sql: str) -> str:
    return textwrap.dedent(sql).strip()


def target(sql: str, fmt: int, ref: str = "A") -> dict:
    return {
        "datasource": DATASOURCE,
        "editorType": "sql",
        "format": fmt,
        "queryType": _QUERY_TYPE[fmt],
        "rawSql": sql_text(sql),
        "refId": ref,
    }


def override(field: str, **properties) -> dict:
    """Field properties for the column named ``field`` (``unit``, ``links``, ``displayName``, ...)."""
    return {
        "matcher": {"id": "byName", "options": field},
        "properties": [{"id": key.replace("_", "."), "value": value} for key, value in properties.items()],
    }


def trace_lookup_link(field: str, title: str = "Look up this request") -> dict:
    """A data link that opens the trace-lookup dashboard with ``request_id`` set to the clicked row's ``field``."""
    return {
        "title": title,
        "url": f"/d/{TRACE_LOOKUP_UID}/{TRACE_LOOKUP_UID}?var-request_id=${{__data.fields.{field}:percentencode}}"
        "&${datasource:queryparam}",
    }


def _panel(kind: str, title: str, description: str, unit: str, width: int, height: int, **extra) -> dict:
    panel = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"h": height, "w": width, "x": 0, "y": 0},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {},
    }
    panel.update(extra)
    return panel


def timeseries(
    title: str,
    sql: str,
    unit: str,
    *,
    description: str,
    width: int = 12,
    height: int = 8,
    bars: bool = False,
    max_value: float | None = None,
    repeat: str | None = None,
) -> dict:
    panel = _panel(
        kind="timeseries",
        title=title,
        description=description,
        unit=unit,
        width=width,
        height=height,
        targets=[target(sql, TIME_SERIES)],
    )
    defaults = panel["fieldConfig"]["defaults"]
    defaults["min"] = 0  # every series stagetrace plots is a count, a rate, a share or a size
    if max_value is not None:
        defaults["max"] = max_value
    defaults["custom"] = {
        "drawStyle": "bars" if bars else "line",
        "fillOpacity": 60 if bars else 10,
        "lineWidth": 1,
        "showPoints": "never",
        "spanNulls": False,
    }
    panel["options"] = {
        "legend": {"displayMode": "table", "placement": "bottom", "showLegend": True, "calcs": ["mean", "max"]},
        "tooltip": {"mode": "multi", "sort": "desc"},
    }
    if repeat:
        panel.update({"repeat": repeat, "repeatDirection": "h", "maxPerRow": 5})
    return panel


def stat(
    title: str,
    sql: str,
    unit: str,
    *,
    description: str,
    width: int = 4,
    height: int = 4,
    thresholds: Sequence[tuple[float, str]] = (),
) -> dict:
    panel = _panel("stat", title, description, unit, width, height, targets=[target(sql, TABLE)])
    steps = [{"color": "green", "value": None}] + [{"color": color, "value": value} for value, color in thresholds]
    panel["fieldConfig"]["defaults"]["thresholds"] = {"mode": "absolute", "steps": steps}
    panel["options"] = {
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "colorMode": "value",
        "graphMode": "none",
        "textMode": "value",
    }
    return panel


def table(
    title: str,
    sql: str,
    unit: str,
    *,
    description: str,
    width: int = 24,
    height: int = 8,
    overrides: Iterable[dict] = (),
    sort_by: str | None = None,
) -> dict:
    panel = _panel("table", title, description, unit, width, height, targets=[target(sql, TABLE)])
    panel["fieldConfig"]["overrides"] = list(overrides)
    panel["options"] = {"showHeader": True, "cellHeight": "sm", "footer": {"show": False}}
    if sort_by:
        panel["options"]["sortBy"] = [{"displayName": sort_by, "desc": True}]
    return panel


def traces(title: str, sql: str, *, description: str, width: int = 24, height: int = 14) -> dict:
    # The Traces panel ignores units; "ms" documents what its duration column holds.
    return _panel("traces", title, description, "ms", width, height, targets=[target(sql, TRACES)])


def logs(title: str, sql: str, *, description: str, width: int = 24, height: int = 8) -> dict:
    # the Logs panel reads a time column, a body and a level (the plugin's logs format)
    return _panel("logs", title, description, "none", width, height, targets=[target(sql, LOGS)])


def row(title: str) -> dict:
    grid = {"h": 1, "w": 24, "x": 0, "y": 0}
    return {"type": "row", "title": title, "collapsed": False, "gridPos": grid, "panels": []}


# ---------------------------------------------------------------------------------------------
# Template variables


def datasource_variable() -> dict:
    return {
        "type": "datasource",
        "name": "datasource",
        "label": "ClickHouse",
        "query": DATASOURCE_TYPE,
        "current": {"selected": False, "text": DATASOURCE_NAME, "value": DATASOURCE_UID},
        "hide": 0,
        "refresh": 1,
        "regex": "",
    }


def query_variable(name: str, label: str, sql: str, *, multi: bool = True, description: str = "") -> dict:
    """Values from a ClickHouse query (one column, or value and text), refreshed when the time range changes."""
    sql = sql_text(sql)
    variable = {
        "type": "query",
        "name": name,
        "label": label,
        "description": description,
        "datasource": DATASOURCE,
        "query": {"editorType": "sql", "rawSql": sql},
        "definition": sql,
        "refresh": 2,
        "sort": 0,  # the query orders its values
        "multi": multi,
        "includeAll": multi,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]} if multi else {},
        "hide": 0,
        "options": [],
        "regex": "",
    }
    return variable


def text_variable(name: str, label: str, description: str) -> dict:
    return {
        "type": "textbox",
        "name": name,
        "label": label,
        "description": description,
        "query": "",
        "current": {"selected": False, "text": "", "value": ""},
        "options": [],
        "hide": 0,
    }


# ---------------------------------------------------------------------------------------------
# The dashboard


def _layout(panels: Sequence[dict]) -> list[dict]:
    """Flow panels left to right, wrapping at 24 columns; a row starts on a new line."""
    placed: list[dict] = []
    x = y = line_height = 0
    for number, panel in enumerate(panels, start=1):
        panel = {"id": number, **panel}
        grid = dict(panel["gridPos"])
        if panel["type"] == "row" or x + grid["w"] > 24:
            x, y, line_height = 0, y + line_height, 0
        grid["x"], grid["y"] = x, y
        panel["gridPos"] = grid
        x += grid["w"]
        line_height = max(line_height, grid["h"])
        if panel["type"] == "row":
            x, y, line_height = 0, y + grid["h"], 0
        placed.append(panel)
    return placed


def dashboard(
    uid: str,
    title: str,
    description: str,
    panels: Sequence[dict],
    variables: Sequence[dict],
    *,
    time_from: str = "now-6h",
    refresh: str = "1m",
) -> dict:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": [TAG],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,  # shared crosshair: hardware and pipeline panels line up in time
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "time": {"from": time_from, "to": "now"},
        "refresh": refresh,
        "links": [
            {
                "type": "dashboards",
                "tags": [TAG],
                "asDropdown": True,
                "title": "stagetrace dashboards",
                "includeVars": False,
                "keepTime": True,
            }
        ],
        "templating": {"list": list(variables)},
        "annotations": {"list": []},
        "panels": _layout(panels),
    }
