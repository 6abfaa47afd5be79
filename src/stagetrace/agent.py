"""``stagetrace agent`` and ``stagetrace collect``: the node's collectors on ``/metrics`` and in ClickHouse.

The agent serves ``/metrics`` (collected at scrape time) and, every interval, collects once more and
writes the samples to the store. SIGTERM or SIGINT stops it: it writes what it holds and exits 0.
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import threading
import time

from stagetrace.collectors.base import Node
from stagetrace.exporters.clickhouse import ClickHouseMetricWriter
from stagetrace.exporters.prometheus import serve

logger = logging.getLogger("stagetrace.agent")

_INTERVAL = re.compile(r"\s*(\d+(?:\.\d*)?)\s*(ms|s|m|h)\s*")
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


class AgentError(Exception):
    """An expected failure to start the agent; its message is one line a person can act on."""


def parse_interval(text: str) -> float:
    """``500ms``, ``5s``, ``1.5m``, ``1h`` -> seconds; ValueError says how to write it."""
    match = _INTERVAL.fullmatch(text)
    seconds = float(match[1]) * _SECONDS[match[2]] if match else 0.0
    if seconds <= 0:
        raise ValueError(f"interval {text!r} is not a positive duration: write e.g. 500ms, 5s or 1m")
    return seconds


class SerializedNode:
    """The node behind a lock, so a scrape and the writer's sample never run the collectors at once."""

    def __init__(self, node: Node):
        self.node = node
        self._lock = threading.Lock()

    def collect(self) -> list:
        with self._lock:
            return list(self.node.collect())


def failed_collectors(families) -> list[str]:
    """The collectors whose ``stagetrace_collector_success`` is 0 in these families."""
    return [
        sample.labels["collector"]
        for family in families
        if family.name == "stagetrace_collector_success"
        for sample in family.samples
        if sample.value == 0
    ]


def samples_json(families) -> list[dict]:
    """One ``{name, type, help, labels, value}`` per sample, for ``collect --format json``."""
    return [
        {"name": s.name, "type": f.type, "help": f.documentation, "labels": dict(s.labels), "value": s.value}
        for f in families
        for s in f.samples
        if not (f.type == "counter" and s.name.endswith("_created"))
    ]


def run(node: Node, *, listen: str, interval_s: float, store: str | None, stop: threading.Event | None = None) -> int:
    """Serve and write until ``stop`` is set or SIGTERM/SIGINT arrives; returns the exit status (0)."""
    stop = stop or threading.Event()
    shared = SerializedNode(node)
    with contextlib.ExitStack() as cleanup:  # undone in reverse: signals, server, writer (flushes), node
        cleanup.callback(node.close)
        writer = ClickHouseMetricWriter(store, host=node.host)
        cleanup.callback(writer.close)
        try:
            server = serve(shared, listen)
        except OSError as exc:
            raise AgentError(f"cannot listen on {listen}: {exc.strerror or exc} (choose another with --listen)") from None
        cleanup.callback(server.close)
        for sig in (signal.SIGTERM, signal.SIGINT):
            cleanup.callback(signal.signal, sig, signal.signal(sig, lambda *_: stop.set()))
        logger.info(
            "serving %s, writing every %gs to %s (collectors: %s)", server.url, interval_s,
            writer.store.location.redacted(), ", ".join(c.name for c in node.collectors) or "none",
        )  # fmt: skip
        due = time.monotonic()
        while True:
            writer.write(shared.collect())
            # keep the cadence; after a stall (slow store, suspended host) start again from now
            due = max(due + interval_s, time.monotonic())
            if stop.wait(due - time.monotonic()):
                break
        logger.info("stopping")
    return 0


__all__ = ["AgentError", "SerializedNode", "failed_collectors", "parse_interval", "run", "samples_json"]
