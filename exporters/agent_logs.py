"""The agent's own log lines into the store's ``otel_logs``, beside the engines' (``stagetrace agent --agent-logs
store``): a disk that filled, a broken part, a refused sender, seen in Grafana where the traces are.

A ``logging.Handler`` keeps each record as an ``otel_logs`` row (the Collector's columns, ``rows.LOG_COLUMNS``:
service ``stagetrace-agent``, the host, severity by OpenTelemetry's numbers, the logger and code location as the
OpenTelemetry SDK's logging handler names them) and a thread writes them every ``every_s`` through the durable write
path (``DurableWriter``: in the store or the fsynced spool). The lines are few (one per state change), so a bounded
buffer suffices: past ``MAX_PENDING`` rows the oldest go, counted. Lines logged while the rows are being written
(the writer's own complaints) wait for the next write.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from stagetrace import __version__
from stagetrace.exporters.durable import DurableWriter
from stagetrace.exporters.rows import AGENT_SERVICE, LOG_COLUMNS, LOGS_TABLE

MAX_PENDING = 10_000
SCOPE = "stagetrace.agent"
# Python's levels as OpenTelemetry's severity numbers (the log data model's ranges: DEBUG 5, INFO 9, WARN 13, ...)
_SEVERITY = ((logging.CRITICAL, 21), (logging.ERROR, 17), (logging.WARNING, 13), (logging.INFO, 9), (0, 5))


def severity_number(level: int) -> int:
    return next(number for floor, number in _SEVERITY if level >= floor)


class StoreLogHandler(logging.Handler):
    """Log records of ``level`` and above as ``otel_logs`` rows of ``host``, written every ``every_s`` by a thread
    of its own (see the module docstring)."""

    def __init__(self, store, host: str, *, level: int = logging.INFO, every_s: float = 2.0, headroom=None):
        super().__init__(level)
        self.writer = DurableWriter(store, "logs", headroom=headroom)
        self.resource = {"host.name": host, "service.name": AGENT_SERVICE}
        self.every_s = every_s
        self.dropped = 0  # rows dropped from a full buffer
        self._pending: deque[tuple] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stagetrace-agent-logs", daemon=True)
        self._thread.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            row = (
                int(record.created * 1e9),
                "",
                "",
                0,
                record.levelname,
                severity_number(record.levelno),
                AGENT_SERVICE,
                self.format(record),
                "",
                self.resource,
                "",
                SCOPE,
                __version__,
                {},
                {
                    "code.namespace": record.name,
                    "code.filepath": record.pathname,
                    "code.function": record.funcName,
                    "code.lineno": str(record.lineno),
                },
            )
        except Exception:  # a record that cannot be formatted: logging's own way of saying so
            self.handleError(record)
            return
        with self._lock:
            self._pending.append(row)
            self._trim()

    def _trim(self) -> None:
        while len(self._pending) > MAX_PENDING:  # the oldest go
            self._pending.popleft()
            self.dropped += 1

    def flush(self) -> None:
        """Write what is pending now; what neither the store nor the spool took (a full disk) waits for the next."""
        with self._lock:
            rows = list(self._pending)
            self._pending.clear()
        if rows and not self.writer.write(LOGS_TABLE, LOG_COLUMNS, rows):
            with self._lock:
                self._pending.extendleft(reversed(rows))  # before what was logged meanwhile
                self._trim()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.flush()
        self.writer.close()
        super().close()
