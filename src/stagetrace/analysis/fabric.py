"""Where a stage's hardware signals are weighed: a span's own host and devices over its own window, or, for a transfer
over the fabric whose spans name no NIC, each end of it.

SGLang's prefill/decode disaggregation moves the KV cache from the prefill server to the decode server over RDMA
(mooncake); its spans (``conventions.KV_TRANSFER``) name no NIC, and the transfer has two ends, each half's spans on
its own host. So the first pass of the stage stands for neither end alone: each half (``prefill``, ``decode``: its
root's role, ``conventions.disaggregated_role``) is weighed on its host, over the window from its first transfer span's
start to its last one's end, with every NIC read on that host (``hardware.weighed``).
"""

from __future__ import annotations

from dataclasses import dataclass

from stagetrace import conventions, lookup
from stagetrace.analysis.hardware import Rise, Samples, devices, weighed


@dataclass(frozen=True)
class Watched:
    """One place and window whose signals count for a rank of the divergent stage."""

    half: str  # the half of a disaggregated request (``prefill``/``decode``); "" for a span weighed as itself
    host: str
    gpus: tuple[str, ...]
    nics: tuple[str, ...]
    start_ns: int
    end_ns: int
    span: lookup.Span  # the span that stands for it (its first)

    def rises(self, samples: Samples) -> list[Rise]:
        return samples.rises(self.host, list(self.gpus), list(self.nics), self.start_ns, self.end_ns)


def watched(trace: lookup.Trace, stage: str, span: lookup.Span, samples: Samples) -> list[Watched]:
    """Where the signals count for ``span``, a first pass of ``stage`` in ``trace``: the span itself; or, when it moves
    data over the fabric and names no NIC, each end of the transfer (the passes of the stage at its rank that do the
    same, by half and host)."""
    host = span.resource.get("host.name", "")
    if not _unnamed_transfer(span):
        gpus, nics = weighed(samples, span)
        return [Watched("", host, tuple(gpus), tuple(nics), span.start_ns, span.start_ns + span.duration_ns, span)]
    passes = [s for s in trace.stages.get((stage, span.rank), [span]) if _unnamed_transfer(s)] or [span]
    halves = _halves(trace)
    ends: dict[tuple[str, str], list[lookup.Span]] = {}
    for s in passes:
        ends.setdefault((halves.get(s.span_id) or _named_half(s.name), s.resource.get("host.name", "")), []).append(s)
    out = []
    for (half, where), spans in sorted(ends.items()):
        gpus = dict.fromkeys(g for s in spans for g in devices(s.attributes)[0])
        nics = dict.fromkeys(n for s in spans for n in weighed(samples, s)[1])
        out.append(
            Watched(
                half,
                where,
                tuple(gpus),
                tuple(nics),
                min(s.start_ns for s in spans),
                max(s.start_ns + s.duration_ns for s in spans),
                spans[0],
            )
        )
    return out


def _unnamed_transfer(span: lookup.Span) -> bool:
    return conventions.moves_over_fabric(span.name) and not devices(span.attributes)[1]


def _named_half(name: str) -> str:
    """The half SGLang's transfer slice names itself for (``prefill_transfer_kv_cache``, ``decode_transferred``):
    what tells the ends apart where the roots were not read (``divergences`` reads stage spans only)."""
    role = name.partition("_")[0]
    return role if role in conventions.DISAGGREGATED_ROLES else ""


def _halves(trace: lookup.Trace) -> dict[str, str]:
    """Span ID -> the half of a disaggregated request (``prefill``/``decode``) whose root encloses it: its nearest
    enclosing ``<role> Req <rid8>`` (an application's spans may sit above that root)."""
    by_id = {s.span_id: s for s in trace.spans}
    out: dict[str, str] = {}
    for span in trace.spans:
        above, seen = span, 0
        while above is not None and seen < 256:  # a cycle of bad IDs ends here, not in a hang
            role = conventions.disaggregated_role(above.name)
            if role:
                out[span.span_id] = role
                break
            above, seen = by_id.get(above.parent_span_id), seen + 1
    return out
