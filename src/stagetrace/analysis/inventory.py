"""The GPU inventory (the gpu collector's ``gpu_info`` series), joined to spans whose process recorded no configuration.

A process started with stagetrace's resource detector records its GPUs' model, driver and CUDA versions as
resource attributes; one started without it records none, but its spans name their host (``host.name``) and
often their GPU (``gpu.uuid``). The agent exports each GPU's inventory as ``gpu_info{gpu, uuid, model,
driver_version, cuda_version, ...}``, so the analysis fills those attributes in by host and GPU UUID
(``conventions.INVENTORY_LABELS``), never over what the process recorded itself. A span without a GPU UUID (or
with one the inventory does not know) gets a host's value only when all the host's GPUs agree on it.

The inventory is read once per analysis, at one moment (the request's start for ``explain``, the latest deviating
request's for ``divergences``): per GPU, its last sample at or before that moment, else its first after it, within
``LOOKAROUND_NS`` either way. Driver and model change only with a restart, so one moment stands for the window
around it; a driver upgraded inside the window is seen with its value at that moment throughout. Every host's
GPUs are read, not only the request's: the population contrast weighs the value on every host's spans.

The same lookup runs in Python (:meth:`Inventory.value`, for the spans compared) and in the store
(:func:`value_sql`, for the spans the contrast counts), over the same entries, so both read a span the same way.
"""

from __future__ import annotations

import dataclasses

from stagetrace import conventions, lookup
from stagetrace.store import Store

# Info series are written at every sample (seconds apart): this far either side of the moment finds many of them
# while reading only a little of the metric table.
LOOKAROUND_NS = 10 * 60 * 1_000_000_000
# Which of a span's resource attributes came from the inventory (comma-separated names): uncompared, as every
# ``stagetrace.`` name, so that the explanation can say where a value came from.
FILLED = "stagetrace.inventory.filled"

# Per GPU (host, uuid), the labels INVENTORY_LABELS names, from its last sample at or before {t}, else its first after.
INVENTORY_SQL = f"""
SELECT ResourceAttributes['host.name'] AS Host, Attributes['uuid'] AS Uuid,
       argMax(arrayMap(l -> Attributes[l], {{labels:Array(String)}}), (T <= {{t:Int64}}, if(T <= {{t:Int64}}, T, -T)))
FROM (SELECT ResourceAttributes, Attributes, {conventions.time_ns_sql("TimeUnix")} AS T
      FROM {{db:Identifier}}.otel_metrics_gauge
      WHERE MetricName = {{metric:String}}
        AND TimeUnix >= fromUnixTimestamp64Nano({{t0:Int64}}) AND TimeUnix <= fromUnixTimestamp64Nano({{t1:Int64}}))
GROUP BY Host, Uuid
"""


def _key(name: str, host: str, uuid: str) -> str:
    """An entry's key: the attribute, the host and the GPU UUID (``""``: the host's value). Same as ``KEY_SQL``."""
    return f"{name}|{host}|{uuid}"


KEY_SQL = "concat({name}, '|', {host}, '|', {uuid})"


def value_sql(name: str) -> str:
    """:meth:`Inventory.value` in SQL, on a ``stagetrace_stages`` row, for the attribute the SQL expression ``name``
    names: its GPU's value, else its host's, else ``''``. The entries (:meth:`Inventory.entries`) are the parameters
    ``{ik:Array(String)}`` (keys) and ``{iv:Array(String)}`` (values); ``transform`` looks them up by hash."""
    gpu = KEY_SQL.format(name=name, host="HostName", uuid=f"Attributes['{conventions.GPU_UUID}']")
    host = KEY_SQL.format(name=name, host="HostName", uuid="''")

    def lookup(key: str) -> str:
        return f"transform({key}, {{ik:Array(String)}}, {{iv:Array(String)}}, '')"

    return f"if({lookup(gpu)} != '', {lookup(gpu)}, {lookup(host)})"


class Inventory:
    """Per GPU (host, uuid) its configuration attributes (``conventions.INVENTORY_LABELS``' names), and per host the
    values all its GPUs agree on."""

    def __init__(self, gpus: dict[tuple[str, str], dict[str, str]]):
        self.gpus = gpus
        by_host: dict[str, list[dict[str, str]]] = {}
        for (host, _), attributes in gpus.items():
            by_host.setdefault(host, []).append(attributes)
        self.hosts: dict[str, dict[str, str]] = {}
        for host, each in by_host.items():
            for name in conventions.INVENTORY_LABELS:
                values = {attributes.get(name, "") for attributes in each}
                if len(values) == 1 and "" not in values:  # every GPU of the host says the same
                    self.hosts.setdefault(host, {})[name] = values.pop()
        # a sample without a UUID still counts in its host's agreement, but is no GPU a span could name
        self._entries = {
            _key(name, host, uuid): value
            for (host, uuid), attributes in gpus.items()
            if uuid
            for name, value in attributes.items()
            if value
        }
        self._entries.update(
            {
                _key(name, host, ""): value
                for host, attributes in self.hosts.items()
                for name, value in attributes.items()
            }
        )

    def __bool__(self) -> bool:
        return bool(self._entries)

    def value(self, name: str, host: str, uuid: str) -> str:
        """The attribute for a span on ``host`` naming GPU ``uuid`` (``""``: none): its GPU's, else its host's."""
        return self._entries.get(_key(name, host, uuid)) or self._entries.get(_key(name, host, ""), "")

    def entries(self, names) -> dict[str, str]:
        """The entries of these attributes, keyed as ``KEY_SQL`` keys them: the parameters of :func:`value_sql`."""
        prefixes = tuple(f"{name}|" for name in names)
        return {key: value for key, value in self._entries.items() if key.startswith(prefixes)} if prefixes else {}


def read(store: Store, at_ns: int) -> Inventory:
    """The inventory of every host's GPUs at ``at_ns`` (see the module's docstring); empty without gpu_info samples."""
    names = list(conventions.INVENTORY_LABELS)
    rows = store.client.query(
        INVENTORY_SQL,
        parameters={
            "db": store.database,
            "metric": conventions.INVENTORY_METRIC,
            "t": at_ns,
            "labels": [conventions.INVENTORY_LABELS[n] for n in names],
            "t0": at_ns - LOOKAROUND_NS,
            "t1": at_ns + LOOKAROUND_NS,
        },
    ).result_rows
    return Inventory({(host, uuid): dict(zip(names, values)) for host, uuid, values in rows if host})


def fill(resource: dict[str, str], attributes: dict[str, str], inventory: Inventory) -> dict[str, str]:
    """The span's resource with the inventory's attributes added where the resource lacks them (never over what
    the process recorded); the names added are listed under ``FILLED``. The resource itself when nothing is added."""
    host, uuid = resource.get(conventions.HOST, ""), attributes.get(conventions.GPU_UUID, "")
    added = {
        name: value
        for name in conventions.INVENTORY_LABELS
        if not resource.get(name) and (value := inventory.value(name, host, uuid))
    }
    if not added:
        return resource
    return {**resource, **added, FILLED: ",".join(added)}


def filled(trace: lookup.Trace, inventory: Inventory) -> lookup.Trace:
    """A copy of the trace whose spans' resources have the inventory filled in (the trace itself when it is empty)."""
    if trace is None or not inventory:
        return trace
    spans = [dataclasses.replace(s, resource=fill(s.resource, s.attributes, inventory)) for s in trace.spans]
    return dataclasses.replace(trace, spans=spans)


def filled_names(resource: dict[str, str]) -> list[str]:
    """The resource attributes :func:`fill` added from the inventory."""
    return [name for name in resource.get(FILLED, "").split(",") if name]
