"""The metric model at the core: metrics described as data (:class:`MetricSpec`: name, type, help, unit, labels),
the way dcgm-exporter describes its counters, and :class:`Samples`, one scrape's series grouped into Prometheus
families. Collectors build them; the agent's own metrics (store health, live analysis, co-tenants), ``/metrics``
and the ClickHouse writer read them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client.core import Metric

COUNTER, GAUGE, INFO = "counter", "gauge", "info"


@dataclass(frozen=True)
class MetricSpec:
    """One metric, described as data. Counter names end in ``_total``; base units are in the name."""

    name: str
    type: str
    help: str
    labels: tuple[str, ...] = ()
    unit: str = ""  # e.g. "bytes", "watts", "seconds", "celsius": kept as the sample's MetricUnit

    def __post_init__(self):
        if self.type not in (COUNTER, GAUGE, INFO):
            raise ValueError(f"{self.name}: type must be counter, gauge or info")
        if (self.type == COUNTER) != self.name.endswith("_total"):
            raise ValueError(f"{self.name}: counters, and only counters, end in _total")
        # client_python appends the unit to a name that does not end in it; the name must carry it already
        if self.unit and not self.name.removesuffix("_total").endswith(f"_{self.unit}"):
            raise ValueError(f"{self.name}: the name must end in its unit, _{self.unit}")
        # Samples keys every series by its spec: hash the five fields once, not at each of a scrape's adds
        object.__setattr__(self, "_hash", hash((self.name, self.type, self.help, self.labels, self.unit)))

    def __hash__(self) -> int:
        return self._hash


class Samples:
    """The samples of one collector in one scrape, grouped into metric families by spec."""

    def __init__(self):
        self._values: dict[MetricSpec, list[tuple[tuple[str, ...], float | Mapping[str, str]]]] = {}

    def add(self, spec: MetricSpec, value, **labels) -> None:
        """Add one series; ``labels`` must be exactly ``spec.labels``. Info metrics take a dict as value."""
        try:
            values = tuple([str(labels[k]) for k in spec.labels])  # a list first: faster than a generator
        except KeyError:
            values = None
        if values is None or len(labels) != len(spec.labels):
            raise ValueError(f"{spec.name}: labels {sorted(labels)} do not match {list(spec.labels)}")
        self.add_series(spec, values, value)

    def add_series(self, spec: MetricSpec, label_values: tuple[str, ...], value) -> None:
        """:meth:`add` with the label values as text in ``spec.labels`` order: for a collector adding many series
        under the same labels (a port's counters), without a keyword dict and a conversion per series."""
        if len(label_values) != len(spec.labels):
            raise ValueError(f"{spec.name}: {len(label_values)} label values for labels {list(spec.labels)}")
        series = self._values.get(spec)
        if series is None:
            series = self._values[spec] = []
        series.append((label_values, value))

    def series(self) -> Iterator[tuple[MetricSpec, tuple[str, ...], Any]]:
        """Every series added as (spec, label values in ``spec.labels`` order, value); an info metric's value is its
        dict of labels."""
        for spec, series in self._values.items():
            for values, value in series:
                yield spec, values, value

    def families(self, host: str) -> Iterator[Metric]:
        # here, not at the top: the metric specs are read by commands that build no families (`stagetrace trace`),
        # and client_python with its exposition server takes 20 ms to import
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        for spec, series in self._values.items():
            names = ["host", *spec.labels]
            if spec.type == INFO:
                family = InfoMetricFamily(spec.name.removesuffix("_info"), spec.help, labels=names)
            elif spec.type == COUNTER:
                family = CounterMetricFamily(spec.name, spec.help, labels=names, unit=spec.unit)
            else:
                family = GaugeMetricFamily(spec.name, spec.help, labels=names, unit=spec.unit)
            for values, value in series:
                family.add_metric([host, *values], value)
            yield family


__all__ = ["COUNTER", "GAUGE", "INFO", "MetricSpec", "Samples"]
