"""Cause detectors: plug-ins that, given a deviating request, its baseline, its divergent stage and the store,
propose scored candidate causes with their evidence.

A detector is an object with a ``name`` and ``detect(case) -> list[Cause]``, registered with :func:`register`;
adding a kind of cause is one module in this package, named in ``MODULES``. The explanation runs every
registered detector on the same :class:`Case` and ranks what they found together (``causes.ranked``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Protocol

from stagetrace import conventions, lookup
from stagetrace.analysis.causes import Cause, Contrast, OnRank
from stagetrace.analysis.hardware import Samples
from stagetrace.analysis.tenants import Tenancy
from stagetrace.store import Store

# Module names, which are the detectors' names, in the order they run.
MODULES = ("attributes", "hardware", "cotenants", "rollout", "nondeterminism", "weights", "prefix_cache")


@dataclass
class Case:
    """What a detector may look at. ``spans``/``baseline_spans``: the divergent stage's first pass per TP rank
    (``""`` when it has none); when the request skipped the stage, its root stands in for it."""

    store: Store
    request: lookup.Trace
    baseline: lookup.Trace
    stage: str
    spans: dict[str, lookup.Span]
    baseline_spans: dict[str, lookup.Span]
    contrast: Contrast | OnRank | None = None
    samples: Samples | None = None
    rollouts: list = field(default_factory=list)  # rollouts.Rollout around the request
    nondeterminism: str = ""  # the request's reason to differ by design, if any
    tenancy: Tenancy | None = None  # the tenants of the GPUs, read once for many cases (else each case reads its own)
    # the stored spans that record a prefix-cache hit, by trace ID, read once for many cases (else each case reads
    # its own: prefix_cache.stored)
    cache_hits: dict[str, list[tuple]] | None = None

    @property
    def span(self) -> lookup.Span:
        """The request's span that describes how the stage ran (its lowest rank)."""
        return self.spans[self.first_rank]

    @property
    def baseline_span(self) -> lookup.Span | None:
        return self.baseline_spans.get(self.first_rank)

    @property
    def first_rank(self) -> str:
        return min(self.spans, key=conventions.rank_order)


class Detector(Protocol):
    name: str

    def detect(self, case: Case) -> list[Cause]: ...


REGISTRY: dict[str, Detector] = {}


def register(cls):
    """Class decorator: make a detector available under ``cls.name``."""
    if not cls.name or cls.name in REGISTRY:
        raise ValueError(f"detector name {cls.name!r} is empty or already registered")
    REGISTRY[cls.name] = cls()
    return cls


def detectors() -> list[Detector]:
    for name in MODULES:
        importlib.import_module(f"stagetrace.analysis.detectors.{name}")
    return [REGISTRY[name] for name in MODULES]


def detect(case: Case) -> list[Cause]:
    """Every detector's candidates for one case, unranked."""
    return [cause for detector in detectors() for cause in detector.detect(case)]
