"""Prometheus ``/metrics``: the node's collectors run at scrape time, served by client_python's own server."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest, start_http_server

DEFAULT_LISTEN = "127.0.0.1:9464"


def parse_listen(text: str) -> tuple[str, int]:
    """``127.0.0.1:9464``, ``[::1]:9464`` or ``:9464`` (loopback) -> (address, port); ValueError says how to write it."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"listen address {text!r} is not HOST:PORT: write e.g. 127.0.0.1:9464")
    return host, int(port)


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


@dataclass
class MetricsServer:
    """A running ``/metrics`` server; ``port`` is the bound one (useful with port 0)."""

    server: object
    thread: object
    address: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve(node, listen: str = DEFAULT_LISTEN) -> MetricsServer:
    """Serve ``node`` on ``listen``; OSError when the address cannot be bound (in use, not local)."""
    address, port = parse_listen(listen)
    server, thread = start_http_server(port, addr=address, registry=registry_for(node))
    return MetricsServer(server, thread, address, server.server_address[1])


__all__ = ["DEFAULT_LISTEN", "MetricsServer", "exposition", "parse_listen", "registry_for", "serve"]
