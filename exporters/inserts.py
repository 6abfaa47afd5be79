"""One plain insert: rows into a table of either generation, column by column.

The durable writer's inserts, the restorer's put-back and the demo's hardware samples all go through it; it knows
nothing of tokens, spools or retries (``exporters.durable`` adds those).
"""

from __future__ import annotations

from stagetrace.store import Store


def insert_rows(store: Store, table: str, rows: list, columns, types=None, settings=None) -> None:
    """Insert rows (times in nanoseconds) into a table of either generation, column by column; ``types``: the
    columns' types, when the caller asked the store for them once already."""
    if types is None:
        types = store.client.create_insert_context(
            table, column_names=list(columns), database=store.database
        ).column_types
    # transposed by zip, in C: clickhouse-connect's own transposition of rows is slower (5-25% of a 4,096-span
    # insert, measured)
    store.client.insert(
        table,
        _in_seconds(list(zip(*rows)), types),
        column_names=columns,
        database=store.database,
        column_types=types,
        settings=settings,
        column_oriented=True,
    )


def _in_seconds(data: list, types) -> list:
    """Columns of nanosecond times made whole seconds where the table keeps seconds: the Collector's current metric
    tables have ``DateTime`` times, its previous ones and stagetrace's ``DateTime64(9)`` (``schema.check``)."""
    for i, column_type in enumerate(types):
        if column_type.base_type == "DateTime":  # DateTime64's base type is DateTime64
            data[i] = [v // 1_000_000_000 if isinstance(v, int) else v for v in data[i]]
    return data
