"""Expand a dashboard or alert query the way Grafana and the ClickHouse data source plugin do.

What ClickHouse finally runs is the panel's ``rawSql`` after three steps, in the plugin's order
(grafana/clickhouse-datasource ``CHDatasource.applyTemplateVariables``, then its Go backend):

1. ``$__conditionalAll(condition, $var)`` becomes ``1=1`` when ``var`` is All or empty, else ``condition``
   (frontend only: alert rules never see it).
2. Grafana's template variables: ``$var``, ``${var}``, ``${var:format}``, ``[[var]]``, with the plugin's
   default format (multi-value ``'a','b'``, single value raw) unless the reference names a format.
3. The backend macros (``pkg/macros/macros.go``): ``$__timeFilter(col)``, ``$__timeInterval(col)``, ...
   Macros inside string literals, quoted identifiers and comments are left alone, as the plugin's lexer does.

The tests run every dashboard and alert query through :func:`expand` before giving it to ClickHouse,
so a query only passes if it works after exactly these rewrites.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from urllib.parse import quote

ALL = "$__all"  # the value Grafana stores when "All" is selected


class MacroError(ValueError):
    """A query uses a macro, argument count or variable format the data source would reject."""


@dataclass(frozen=True)
class Variable:
    """A dashboard variable's current value, as Grafana holds it."""

    value: str | tuple[str, ...]  # ALL (or (ALL,)) when "All" is selected
    options: tuple[str, ...] = ()  # the values "All" stands for
    all_value: str | None = None  # the variable's custom all value, inserted unformatted (as Grafana does)

    @property
    def is_all(self) -> bool:
        return self.value == ALL or (isinstance(self.value, tuple) and self.value[:1] == (ALL,))


@dataclass(frozen=True)
class QueryContext:
    """The time range and interval Grafana sends with a query (the backend's ``sqlutil.Query``)."""

    time_from: datetime
    time_to: datetime
    interval_ms: int = 1000  # the panel's $__interval
    table: str = ""  # query-builder context for $__table / $__column; empty for SQL-editor queries
    column: str = ""

    def __post_init__(self):
        for name in ("time_from", "time_to"):
            if getattr(self, name).tzinfo is None:
                raise ValueError(f"{name} must be timezone-aware: Grafana sends UTC instants")


def expand(sql: str, context: QueryContext, variables: Mapping[str, Variable | str | list[str]] | None = None) -> str:
    """The SQL ClickHouse receives for ``sql`` (frontend rewrites, then backend macros)."""
    resolved = {name: _as_variable(value) for name, value in (variables or {}).items()}
    sql = apply_conditional_all(sql, resolved)
    sql = interpolate(sql, resolved, context)
    return expand_macros(sql, context)


def _as_variable(value: Variable | str | list[str] | tuple[str, ...]) -> Variable:
    if isinstance(value, Variable):
        return value
    return Variable(tuple(value) if isinstance(value, (list, tuple)) else value)


# ---------------------------------------------------------------------------------------------
# 1. $__conditionalAll: a plain text rewrite with the plugin's own argument splitting

_CONDITIONAL_ALL = "$__conditionalAll("
_VARIABLE_ARGUMENT = re.compile(r"(?<=\$\{)[\w\d]+(?=\})|(?<=\$)[\w\d]+")


def apply_conditional_all(sql: str, variables: Mapping[str, Variable]) -> str:
    """``CHDatasource.applyConditionalAll``: last occurrence first, arguments split at depth-1 commas, untrimmed."""
    index = sql.rfind(_CONDITIONAL_ALL)
    while index != -1:
        arguments = _frontend_macro_arguments(sql, index + len(_CONDITIONAL_ALL) - 1)
        if len(arguments) != 2:
            return sql  # the plugin gives up and leaves the text as it is
        condition, variable_argument = arguments
        phrase = condition
        match = _VARIABLE_ARGUMENT.search(variable_argument.strip())
        if match and match.group(0) in variables:
            current = variables[match.group(0)]
            value = ",".join(current.value) if isinstance(current.value, tuple) else current.value
            if value in ("", ALL):
                phrase = "1=1"
        sql = sql.replace(f"{_CONDITIONAL_ALL}{condition},{variable_argument})", phrase, 1)
        index = sql.rfind(_CONDITIONAL_ALL)
    return sql


def _frontend_macro_arguments(sql: str, open_paren: int) -> list[str]:
    """``CHDatasource.getMacroArgs``: counts parentheses only (no quote handling), like the plugin."""
    arguments: list[str] = []
    depth = 0
    start = open_paren + 1
    for position in range(open_paren, len(sql)):
        char = sql[position]
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 1:
            arguments.append(sql[start:position])
            start = position + 1
        if char in "()," and depth == 0:
            arguments.append(sql[start:position])
            return arguments
    return []


# ---------------------------------------------------------------------------------------------
# 2. Template variables: Grafana's templateSrv.replace and its format registry

_VARIABLE_REFERENCE = re.compile(r"\$(\w+)|\[\[(\w+?)(?::(\w+))?\]\]|\$\{(\w+)(?:\.([^:^}]+))?(?::([^}]+))?\}")
_REGEX_SPECIAL = re.compile(r"[\\^$*+?.()|\[\]{}/]")


def _percent_encode(value: str) -> str:
    # encodeURIComponent plus the sub-delims !'()* (Grafana's encodeURIComponentStrict)
    return quote(value, safe="-_.~")


def _single(escape: Callable[[str], str]) -> Callable[[str | tuple[str, ...]], str]:
    def formatter(value):
        return ",".join(map(escape, value)) if isinstance(value, tuple) else escape(value)

    return formatter


def _regex(value: str | tuple[str, ...]) -> str:
    if isinstance(value, str):
        return _REGEX_SPECIAL.sub(r"\\\g<0>", value)
    escaped = [_REGEX_SPECIAL.sub(r"\\\g<0>", item) for item in value]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


FORMATS: dict[str, Callable[[str | tuple[str, ...]], str]] = {
    "raw": lambda v: ",".join(v) if isinstance(v, tuple) else v,
    "singlequote": _single(lambda v: "'" + v.replace("'", "\\'") + "'"),
    "doublequote": _single(lambda v: '"' + v.replace('"', '\\"') + '"'),
    "sqlstring": _single(lambda v: "'" + v.replace("'", "''").replace('"', '\\"') + "'"),
    "csv": lambda v: ",".join(v) if isinstance(v, tuple) else v,
    "pipe": lambda v: "|".join(v) if isinstance(v, tuple) else v,
    "json": lambda v: json.dumps(list(v), separators=(",", ":")) if isinstance(v, tuple) else v,
    "percentencode": lambda v: _percent_encode("{" + ",".join(v) + "}" if isinstance(v, tuple) else v),
    "regex": _regex,
    "glob": lambda v: ("{" + ",".join(v) + "}" if len(v) > 1 else ",".join(v)) if isinstance(v, tuple) else v,
}
# The variable's text is its value for every variable stagetrace's dashboards define.
FORMATS["text"] = FORMATS["raw"]


def plugin_default_format(value: str | tuple[str, ...]) -> str:
    """The ClickHouse plugin's ``format``: multi-value ``'a','b'`` (unescaped), single value as it is."""
    return "'" + "','".join(value) + "'" if isinstance(value, tuple) else value


def interpolate(sql: str, variables: Mapping[str, Variable], context: QueryContext | None = None) -> str:
    """``getTemplateSrv().replace(sql, scopedVars, plugin.format)``; unknown names are left as they are."""
    builtins = _builtin_variables(context) if context else {}

    def replace(match: re.Match) -> str:
        name = match.group(1) or match.group(2) or match.group(4)
        fmt = match.group(3) or match.group(6)
        if name in builtins:
            return builtins[name]
        variable = variables.get(name)
        if variable is None:
            return match.group(0)
        value = variable.value
        if variable.is_all:
            if variable.all_value is not None and fmt not in ("text", "percentencode"):
                return variable.all_value
            value = tuple(variable.options) if variable.all_value is None else variable.all_value
        if fmt is None:
            return plugin_default_format(value)
        formatter = FORMATS.get(fmt.split(":")[0])
        if formatter is None:
            raise MacroError(f"variable format {fmt!r} in {match.group(0)} is not one this expander models")
        return formatter(value)

    return _VARIABLE_REFERENCE.sub(replace, sql)


def _builtin_variables(context: QueryContext) -> dict[str, str]:
    """Global variables Grafana's frontend fills in before the data source sees the query."""
    return {
        "__from": str(_unix_ms(context.time_from)),
        "__to": str(_unix_ms(context.time_to)),
        "__interval": _seconds_to_hms(context.interval_ms / 1000),
        "__interval_ms": str(context.interval_ms),
    }


def _seconds_to_hms(seconds: float) -> str:
    """Grafana's ``rangeUtil.secondsToHms``: the largest whole unit only (90 s is ``1m``)."""
    rest = seconds
    for size, unit in ((31536000, "y"), (86400, "d"), (3600, "h"), (60, "m"), (1, "s")):
        whole = math.floor(rest / size)
        if whole:
            return f"{whole}{unit}"
        rest %= size
    milliseconds = math.floor(seconds * 1000)
    return f"{milliseconds}ms" if milliseconds else "less than a millisecond"


# ---------------------------------------------------------------------------------------------
# 3. Backend macros (the plugin's pkg/macros on top of sqlds' defaults)


def _unix_s(moment: datetime) -> int:
    return math.floor(moment.timestamp())  # Go's Time.Unix(): whole seconds, rounded down


def _unix_ms(moment: datetime) -> int:
    return math.floor(moment.timestamp() * 1000)


def _date(moment: datetime) -> str:
    return f"toDate('{moment.astimezone(timezone.utc):%Y-%m-%d}')"


def _date_time(moment: datetime) -> str:
    return f"toDateTime({_unix_s(moment)})"


def _date_time_ms(moment: datetime) -> str:
    return f"fromUnixTimestamp64Milli({_unix_ms(moment)})"


def _interval_seconds(context: QueryContext) -> int:
    return int(max(context.interval_ms / 1000, 1))


def _duration_seconds(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*(ms|s|m|h|d)?\s*", text)
    if not match:
        raise MacroError(f"$__timeGroup interval {text!r} is not a duration like 30s or 5m")
    factor = {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
    return max(int(int(match.group(1)) * factor), 1)


def _filter(column: str, low: str, high: str) -> str:
    return f"{column} >= {low} AND {column} <= {high}"


MacroFunction = Callable[[QueryContext, list[str]], str]

# name -> (argument count, expansion)
MACROS: dict[str, tuple[int, MacroFunction]] = {
    "timeFilter": (1, lambda c, a: _filter(a[0], _date_time(c.time_from), _date_time(c.time_to))),
    "timeFilter_ms": (1, lambda c, a: _filter(a[0], _date_time_ms(c.time_from), _date_time_ms(c.time_to))),
    "dateFilter": (1, lambda c, a: _filter(a[0], _date(c.time_from), _date(c.time_to))),
    "dateTimeFilter": (
        2,
        lambda c, a: (
            f"({_filter(a[0], _date(c.time_from), _date(c.time_to))}) AND "
            f"({_filter(a[1], _date_time(c.time_from), _date_time(c.time_to))})"
        ),
    ),
    "fromTime": (0, lambda c, a: _date_time(c.time_from)),
    "toTime": (0, lambda c, a: _date_time(c.time_to)),
    "fromTime_ms": (0, lambda c, a: _date_time_ms(c.time_from)),
    "toTime_ms": (0, lambda c, a: _date_time_ms(c.time_to)),
    "timeFrom": (1, lambda c, a: f"{a[0]} >= {_date_time(c.time_from)}"),
    "timeTo": (1, lambda c, a: f"{a[0]} <= {_date_time(c.time_to)}"),
    "timeGroup": (2, lambda c, a: f"toStartOfInterval(toDateTime({a[0]}), INTERVAL {_duration_seconds(a[1])} second)"),
    "timeInterval": (1, lambda c, a: f"toStartOfInterval(toDateTime({a[0]}), INTERVAL {_interval_seconds(c)} second)"),
    "timeInterval_ms": (
        1,
        lambda c, a: f"toStartOfInterval(toDateTime64({a[0]}, 3), INTERVAL {max(c.interval_ms, 1)} millisecond)",
    ),
    "interval_s": (0, lambda c, a: str(_interval_seconds(c))),
    "interval": (0, lambda c, a: _seconds_to_hms(c.interval_ms / 1000)),
    "interval_ms": (0, lambda c, a: str(c.interval_ms)),
    "table": (0, lambda c, a: _required(c.table, "$__table")),
    "column": (0, lambda c, a: _required(c.column, "$__column")),
}
MACROS["dt"] = MACROS["dateTimeFilter"]


def _required(value: str, macro: str) -> str:
    if not value:
        raise MacroError(f"{macro} needs a query-builder table or column; SQL-editor queries have none")
    return value


_MACRO_NAME = re.compile(r"\$__([A-Za-z_][A-Za-z0-9_]*)")


def expand_macros(sql: str, context: QueryContext) -> str:
    """Expand every backend macro outside literals and comments; an unknown ``$__name`` is an error."""
    out: list[str] = []
    position = 0
    while position < len(sql):
        skipped = _skip_literal_or_comment(sql, position)
        if skipped != position:
            out.append(sql[position:skipped])
            position = skipped
            continue
        match = _MACRO_NAME.match(sql, position)
        if not match:
            out.append(sql[position])
            position += 1
            continue
        name = match.group(1)
        if name not in MACROS:
            raise MacroError(f"unknown macro $__{name}: the ClickHouse data source would send it to ClickHouse as is")
        count, function = MACROS[name]
        position = match.end()
        arguments: list[str] = []
        if count:
            if position >= len(sql) or sql[position] != "(":
                raise MacroError(f"$__{name} needs {count} argument(s) in parentheses")
            arguments, position = _backend_macro_arguments(sql, position)
            if len(arguments) != count:
                raise MacroError(f"$__{name}: expected {count} argument(s), received {len(arguments)}")
        out.append(function(context, arguments))
    return "".join(out)


def _skip_literal_or_comment(sql: str, position: int) -> int:
    """The index after the string, quoted identifier or comment starting at ``position`` (else ``position``)."""
    char = sql[position]
    if char in "'\"`":
        index = position + 1
        while index < len(sql):
            if sql[index] == "\\":
                index += 2
                continue
            if sql[index] == char:
                if sql[index + 1 : index + 2] == char:  # a doubled quote is an escaped quote
                    index += 2
                    continue
                return index + 1
            index += 1
        return len(sql)
    if sql.startswith("--", position):
        end = sql.find("\n", position)
        return len(sql) if end == -1 else end
    if sql.startswith("/*", position):
        end = sql.find("*/", position + 2)
        return len(sql) if end == -1 else end + 2
    return position


def _backend_macro_arguments(sql: str, open_paren: int) -> tuple[list[str], int]:
    """Arguments split at top-level commas and trimmed; quotes and nested parentheses are respected."""
    arguments: list[str] = []
    depth = 0
    start = open_paren + 1
    position = open_paren
    while position < len(sql):
        skipped = _skip_literal_or_comment(sql, position)
        if skipped != position:
            position = skipped
            continue
        char = sql[position]
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth == 0:
                last = sql[start:position].strip()
                if last or arguments:
                    arguments.append(last)
                return arguments, position + 1
        elif char == "," and depth == 1:
            arguments.append(sql[start:position].strip())
            start = position + 1
        position += 1
    raise MacroError("a macro's parentheses are not closed")
