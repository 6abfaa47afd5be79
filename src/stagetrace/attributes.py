"""How a Collector table keeps its attributes, and the one SQL that reads them as stagetrace does.

The OpenTelemetry Collector's ClickHouse exporter stores attributes in one of two layouts (docs/store.md):
- ``Map(LowCardinality(String), String)`` columns, every value a string (its default, and stagetrace's own tables);
- with ``json: true`` on a pipeline, ``JSON`` columns beside ``*AttributesKeys`` arrays, values as the span sent them
  (numbers, booleans, arrays), and keys split at their dots into paths (``stagetrace.stage`` is a leaf and the parent
  of ``stagetrace.stage.input_digest``).

Every rule stagetrace applies to attributes (``stagetrace.conventions``) is written for the Map layout. Rather than a
second spelling of each rule, a JSON column is read *as* a Map: ``as_map_sql`` is the only place that knows the
difference, and every reader of a Collector table goes through it, by way of ``source_sql`` (the span or log table
with Map attributes, which the materialized views read) or the plain views ``schema`` builds from it
(``stagetrace_spans``, ``stagetrace_logs``: what lookups and dashboards read). On a Map store both are the table.
A JSON value is read as its text (``toString``): ``7``, ``true``, ``0.5`` as the Map layout stores them; an array
reads ``['a','b']`` where the Map layout keeps the JSON ``["a","b"]``.
"""

from __future__ import annotations

MAP, JSON = "Map", "JSON"
LAYOUTS = (MAP, JSON)

# the attribute columns of the Collector's tables stagetrace reads, by table, and the arrays of attributes (a span's
# events' and links', which the trace panel shows)
COLUMNS = {
    "otel_traces": ("ResourceAttributes", "SpanAttributes"),
    "otel_logs": ("ResourceAttributes", "ScopeAttributes", "LogAttributes"),
}
ARRAYS = {"otel_traces": ("Events.Attributes", "Links.Attributes")}

LAYOUT_SQL = """
SELECT table, if(startsWith(type, 'JSON'), 'JSON', 'Map') FROM system.columns
WHERE database = {db:String} AND table IN {tables:Array(String)} AND name IN {columns:Array(String)}"""


def as_map_sql(column: str, layout: str) -> str:
    """``column`` as a ``Map(String, String)``: itself in the Map layout; in the JSON layout its paths and their values
    as text (``JSONAllValues`` yields them in ``JSONAllPaths``' order)."""
    if layout == MAP:
        return column
    if layout == JSON:
        return f"mapFromArrays(JSONAllPaths({column}), JSONAllValues({column}))"
    raise ValueError(f"unknown attribute layout {layout!r}: one of {', '.join(LAYOUTS)}")


def source_sql(table_sql: str, table: str, layout: str) -> str:
    """``table_sql`` (a table or a subquery of ``table``'s rows) as the Map layout has it: every column as it is, the
    attribute columns as Maps. Reads through it use the table's indexes (ClickHouse pushes the filters down)."""
    if layout == MAP:
        return table_sql
    replaced = [f"{as_map_sql(c, layout)} AS {c}" for c in COLUMNS[table]]
    replaced += [f"arrayMap(a -> {as_map_sql('a', layout)}, `{c}`) AS `{c}`" for c in ARRAYS.get(table, ())]
    return f"(SELECT * REPLACE ({', '.join(replaced)}) FROM {table_sql})"


def layouts(client, database: str, tables=tuple(COLUMNS)) -> dict[str, str]:
    """The layout of each of ``tables`` the store has (a table with any JSON attribute column is JSON)."""
    columns = sorted({c for t in tables for c in COLUMNS.get(t.removesuffix("_local"), ())})
    found: dict[str, str] = {}
    for table, layout in client.query(
        LAYOUT_SQL, parameters={"db": database, "tables": list(tables), "columns": columns}
    ).result_rows:
        found[table] = JSON if JSON in (layout, found.get(table)) else MAP
    return found
