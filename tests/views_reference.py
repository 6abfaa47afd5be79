"""The rows the store's views wrote, against the rows the views of schema 10 (before issue 32 made them cheaper) write
from the same spans: ``assert_same_rows(store)`` reads both from one store and compares them row for row.

The reference is the views' SELECTs as schema 10 created them, frozen in ``fixtures/views/schema10.sql``; they are run
over ``otel_traces`` as it is after the test, so any span a test wrote, by any path, is compared.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

REFERENCE = Path(__file__).parent / "fixtures" / "views" / "schema10.sql"


def reference_views() -> list[tuple[str, str, str]]:
    """(view, table it fills, its SELECT with ``{source}``), as schema 10 created them."""
    out = []
    for chunk in (c.strip() for c in REFERENCE.read_text().split("\n;;\n") if c.strip()):
        lines = chunk.splitlines()
        name, target = [line for line in lines if line.startswith("-- ")][-1][3:].split(" -> ")
        out.append((name, target, "\n".join(line for line in lines if not line.startswith("--"))))
    return out


def _hashable(value):
    return tuple(sorted(value.items())) if isinstance(value, dict) else value


def _rows(client, sql: str) -> Counter:
    return Counter(tuple(_hashable(v) for v in row) for row in client.query(sql).result_rows)


def assert_same_rows(store) -> int:
    """Every table a view fills holds the rows schema 10's view writes from the stored spans, no more, no fewer;
    returns how many rows were compared."""
    db = f"`{store.database}`"
    compared = 0
    for name, target, select in reference_views():
        reference = select.format(source=f"{db}.`otel_traces`")
        if target == "otel_traces_trace_id_ts":  # one row per trace and insert until merged: compare per trace
            expected = _rows(store.client, f"SELECT TraceId, min(Start), max(End) FROM ({reference}) GROUP BY TraceId")
            found = _rows(store.client, f"SELECT TraceId, min(Start), max(End) FROM {db}.`{target}` GROUP BY TraceId")
        else:
            columns = store.client.query(f"SELECT * FROM ({reference}) LIMIT 0").column_names
            expected = _rows(store.client, reference)
            found = _rows(store.client, f"SELECT {', '.join(f'`{c}`' for c in columns)} FROM {db}.`{target}`")
        missing, extra = expected - found, found - expected
        assert not missing and not extra, (
            f"{target}: rows of schema 10's {name} missing {list(missing)[:3]}, "
            f"rows it would not write {list(extra)[:3]}"
        )
        compared += sum(expected.values())
    return compared
