"""What was dropped before reaching the store, counted process-wide for ``/metrics``.

One counter for every writer and spool in the process, so that the agent's ``/metrics`` shows a loss wherever it
happened (the spool, the durable writer, the metric writer's memory buffer).
"""

from __future__ import annotations

import threading

from prometheus_client.core import CounterMetricFamily

# why rows were dropped: the ``reason`` label's values
REASONS = (
    "spool_full",  # the spool reached its size limit and dropped its oldest segments
    "spool_write_failed",  # the disk refused a segment (full, read-only, failing)
    "unreadable_segment",  # a segment that no longer decodes
    "rejected_row",  # a row the store refuses for its values; the rest of its batch was stored
    "buffer_full",  # without a spool, more rows waited in memory for a failing store than the bound allows
)


def dropped_kind(table: str) -> str:
    """What the rows of ``table`` (or of a write-ahead record kind) are counted as when dropped."""
    if table in ("otel_traces", "otlp_traces"):
        return "spans"
    return "log_records" if table in ("otel_logs", "otlp_logs") else "metric_samples"


class _Dropped:
    """Process-wide counts of what was dropped, by kind (``spans``, ``metric_samples``) and reason."""

    def __init__(self):
        self._lock = threading.Lock()
        self.counts: dict[tuple[str, str], int] = {}

    def add(self, kind: str, n: int, reason: str) -> None:
        with self._lock:
            self.counts[(kind, reason)] = self.counts.get((kind, reason), 0) + n

    def total(self, kind: str) -> int:
        with self._lock:
            return sum(n for (k, _), n in self.counts.items() if k == kind)

    def families(self, host: str) -> list:
        """``stagetrace_dropped_spans_total``, ``..._metric_samples_total`` and ``..._log_records_total``, labelled ``host`` and
        ``reason`` (every reason, zero included, so that rate() and alerts see the series from the start)."""
        out = []
        for kind, text in (("spans", "Spans"), ("metric_samples", "Metric samples"), ("log_records", "Log records")):
            family = CounterMetricFamily(
                f"stagetrace_dropped_{kind}", f"{text} dropped before reaching the store.", labels=["host", "reason"]
            )
            with self._lock:
                for reason in REASONS:
                    family.add_metric([host, reason], self.counts.get((kind, reason), 0))
            out.append(family)
        return out


DROPPED = _Dropped()

__all__ = ["DROPPED", "REASONS", "dropped_kind"]
