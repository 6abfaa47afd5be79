"""A scrape's samples by name, for the collector tests: ``scrape(node)``, then ``series`` or ``value`` by labels."""

from __future__ import annotations

from stagetrace.collectors.base import Node


def scrape(node: Node) -> dict[str, list[tuple[dict, float]]]:
    """One scrape of ``node``, as name -> [(labels, value)]."""
    return by_name(node.collect())


def by_name(families) -> dict[str, list[tuple[dict, float]]]:
    """Metric families' samples as name -> [(labels, value)]."""
    result: dict[str, list[tuple[dict, float]]] = {}
    for family in families:
        for sample in family.samples:
            result.setdefault(sample.name, []).append((sample.labels, sample.value))
    return result


def series(result, name, **labels) -> list[tuple[dict, float]]:
    """The samples of ``name`` whose labels include ``labels``."""
    wanted = {k: str(v) for k, v in labels.items()}
    return [(lbl, v) for lbl, v in result.get(name, []) if wanted.items() <= lbl.items()]


def value(result, name, **labels) -> float:
    """The one sample of ``name`` with ``labels``."""
    found = series(result, name, **labels)
    assert len(found) == 1, f"{name}{labels}: {len(found)} series"
    return found[0][1]
