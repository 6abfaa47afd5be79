"""The kinds of write-ahead record, and the function that turns each into rows.

A record (``exporters.spool``) is a request as it arrived, kept with its kind; the durable writer's replay and the
restorer read it back through :func:`record_tables`. Any writer replays any record, so what a killed agent wrote ahead
is stored by whichever process writes next.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

# record kind -> "module:function" taking a record's bytes to {table: (columns, rows)}; imported when met
RECORD_KINDS = {
    "otlp_traces": "stagetrace.exporters.otlp:trace_tables",
    "otlp_metrics": "stagetrace.exporters.otlp:metric_tables",
    "otlp_logs": "stagetrace.exporters.otlp:log_tables",
}


def record_tables(kind: str) -> Callable[[bytes], dict[str, tuple]]:
    module, function = RECORD_KINDS[kind].split(":")
    return getattr(importlib.import_module(module), function)
