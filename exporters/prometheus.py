"""Prometheus ``/metrics``: the node's collectors run at scrape time, exposed by client_python and served by the
agent's own HTTP server, so that ``/metrics`` takes the web configuration's TLS and basic auth as every listener
does."""

from __future__ import annotations

import gzip
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from stagetrace import httpd
from stagetrace.httpd import parse_listen

DEFAULT_LISTEN = "127.0.0.1:9464"


def registry_for(node) -> CollectorRegistry:
    """A fresh registry holding only ``node``; it is collected on every scrape, never at registration."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(node)
    return registry


class _Collected:
    """Families collected already, in the shape of a collector."""

    def __init__(self, families):
        self.families = list(families)

    def collect(self):
        return iter(self.families)


def exposition(families) -> bytes:
    """Collected families (e.g. ``list(node.collect())``) in the Prometheus text format."""
    return generate_latest(registry_for(_Collected(families)))


class _MetricsHandler(httpd.Handler):
    registry: CollectorRegistry

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        # every path, as client_python's own server answered: scrape configurations written for it keep working
        body, headers = generate_latest(self.registry), {}
        if "gzip" in (
            self.headers.get("Accept-Encoding") or ""
        ):  # Prometheus asks for it: a scrape's text shrinks ~10x
            body, headers = gzip.compress(body, compresslevel=1), {"Content-Encoding": "gzip"}
        self.reply(200, body, CONTENT_TYPE_LATEST, headers)

    do_HEAD = do_GET


@dataclass
class MetricsServer:
    """A running ``/metrics`` server; ``port`` is the bound one (useful with port 0)."""

    listener: httpd.Listener

    @property
    def port(self) -> int:
        return self.listener.port

    @property
    def url(self) -> str:
        return f"{self.listener.url}/metrics"

    def close(self) -> None:
        self.listener.close()


def serve(node, listen: str = DEFAULT_LISTEN, web=None) -> MetricsServer:
    """Serve ``node`` on ``listen``, with the TLS and basic auth of ``web`` (a ``web_config.WebConfig``); OSError when
    the address cannot be bound (in use, not local)."""
    handler = type("MetricsHandler", (_MetricsHandler,), {"registry": registry_for(node)})
    return MetricsServer(httpd.start(handler, listen, "stagetrace-metrics", web=web))


__all__ = ["DEFAULT_LISTEN", "MetricsServer", "exposition", "parse_listen", "registry_for", "serve"]
