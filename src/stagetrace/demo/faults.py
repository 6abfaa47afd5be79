"""The faults the demo injects, as data: which node, when (as a fraction of the run), and what they do.

Each fault is named by the cause a correct explanation would rank first: the span attribute that
changed, or the hardware counter that rose. The reference pipeline every request would otherwise
follow: the index and the context template most hosts (more than half) run at that moment (``v41``
then ``v42``; ``t3`` then ``t4``), a cache keyed by document revision, a 2,048-token context budget,
ring all-reduce, batch-invariant decoding with the weights of training step 1200, healthy GPUs and
NICs.

A setting rolled out host by host (the index, the template) is a fleet move, not a fault. A host
that runs another value than most hosts is an *expected* change while the wave lasts (ahead of
the fleet, or behind it until the wave's end: as long again after the fleet moved as the fleet took
to move, the rule ``analysis.rollouts`` applies) and a fault once it lags past the wave. The wave
is taken as the requests show it: a host switched with its first request on the new value, and the
fleet moved with the first request of the host that made it most hosts (``observed``, in positions,
picks the reference pipeline); the wave's end is read from the spans' start times, as the analysis
reads it (``demo._conclude``), and those lie on the run's simulated clock (``pipeline.SimClock``), a
function of the requests' positions. So the lagging host's first requests after the fleet's rebuild are
expected changes too, and which ones are depends on the seed alone, not on how fast they were served.

The faults, by role (role r goes to node r % nodes):

- role 0: a co-batched load burst (batch sizes 16-48, 0.40-0.55) flips decode tokens
  (``decode.batch_size``); its NIC times out now and then (0.60-0.95, 15% of requests), and the
  retransmitted chunk is summed last (``rdma_local_ack_timeout_err_total``).
- role 1: cache keyed without the index version, stale texts after the rebuild
  (``cache.entry.index_version``); XID 48 on GPU 0 at 0.80 corrupts a few requests
  (``gpu_xid_errors_total``); its TP group spans two hosts, ranks 2-3 on ``gpu-node-<nodes+1>``
  (a host that serves no requests of its own), whose NIC takes sequence errors (0.30-0.40, 20% of
  requests) so the remote chunk arrives late and is summed last (``rdma_out_of_sequence_total``).
- role 2: restarted with a 640-token context from 0.50 (``context.max_tokens``); its GPU restarted
  at 0.85 from the weights of step 1199 where the fleet serves 1200 (``model.weights.step``).
- role 3: the index rebuild (the other hosts at 0.05) reaches it late, at 0.25, long after the
  fleet moved (``retrieval.index.version``); NCCL_ALGO=Tree from 0.85 (``allreduce.algorithm``).
  On two nodes the rebuild needs both hosts to be most of the fleet, so the node that rebuilt at
  0.05 is ahead of the fleet until 0.25: an expected change, not a fault.
- role 4: its engine restarted at 0.10 with another attention backend (FlashInfer where the fleet
  runs FlashAttention), and back at 0.30: the recurrent step sums in another order
  (``engine.attention_backend``, recorded by the configuration detector on the process's resource).

Every process records its configuration with the resource detector (``stagetrace.configuration``):
the GPUs' model and UUIDs, the driver and CUDA versions, the engine and its numerics settings. The
last node's GPUs are another model (H100 where the fleet runs H200) whose outputs agree: a difference
that explains nothing, and is not in the ground truth.

Not faults, and recorded as such in the ground truth:

- the context template rolls out from ``t3`` to ``t4`` host by host: the first hosts at
  0.50-0.505, the host that makes it most hosts at 0.58, the rest by 0.60. A request whose host runs
  another template than most hosts at that moment is an *expected* change
  (``context.template.version``, ``expected``). The wave is placed so that no host runs another
  template than the fleet while a fault of its own is active, even where the requests show its
  moments a little later than planned: the node with the smaller context is the one that makes it
  most hosts, and node 0 comes last, between the end of its burst and the start of its NIC timeouts.
- one in eight distinct inputs belongs to a tenant that samples at temperature 0.8 without a seed;
  its outputs differ by design (``nondeterministic``).

Not a fault of any output, and not in the ground truth: the last node's device plugin shares its GPUs
through MPS (two replicas each), and a TTS service and a worker, two pods, share its GPU 3
(``shared_gpu``, ``demo.hardware``): the scheduler counts that card twice and the node's 4 GPUs as 8,
which the kubernetes collector's series and the GPU dashboard show. No span runs on GPU 3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from stagetrace.demo.world import (
    FLEET_WEIGHTS_STEP,
    NEW_INDEX,
    OLD_INDEX,
    OTHER_ATTENTION_BACKEND,
    REFERENCE_ATTENTION_BACKEND,
)

REFERENCE_CONTEXT_TOKENS = 2048
SMALL_CONTEXT_TOKENS = 640  # one node served with less context than the model has, like 65,536 of 262,144
OLD_TEMPLATE, NEW_TEMPLATE = "t3", "t4"
# the template's wave: the hosts ahead of the fleet switch over the first span, the host whose switch makes it most
# hosts at FLEET_SWITCH, the hosts behind the fleet over the last span
AHEAD_SWITCH, FLEET_SWITCH, BEHIND_SWITCH = (0.50, 0.505), 0.58, (0.58, 0.60)
RESTARTED_WEIGHTS_STEP = FLEET_WEIGHTS_STEP - 1
REFERENCE_GPU_MODEL, OTHER_GPU_MODEL = "NVIDIA H200", "NVIDIA H100 80GB HBM3"

# stage → {fault → the cause it is recorded under}
CAUSES = {
    "retrieval": {"stale_index": "retrieval.index.version", "index_rollout": "retrieval.index.version"},
    "cache": {"unversioned_cache_key": "cache.entry.index_version"},
    "context_assembly": {"small_context": "context.max_tokens", "template_rollout": "context.template.version"},
    "allreduce": {
        "tree_algorithm": "allreduce.algorithm",
        "nic_timeout": "rdma_local_ack_timeout_err_total",
        "remote_seq_errors": "rdma_out_of_sequence_total",
    },
    "decode": {
        "gpu_xid": "gpu_xid_errors_total",
        "batch_variance": "decode.batch_size",
        "weights_step": "model.weights.step",
        "attention_backend": "engine.attention_backend",
        "unseeded_sampling": "nondeterministic",
    },
}
EXPECTED = {"index_rollout", "template_rollout"}  # changes that are no deviation: the fleet moved
NONDETERMINISTIC = {"unseeded_sampling"}  # outputs that differ by design


@dataclass(frozen=True)
class Wave:
    """A setting moving from an old to a new value host by host (positions are fractions of the run)."""

    first: float  # the first host switches here
    fleet: float  # more than half of the hosts run the new value from here
    until: float  # the wave's end: a host still on the old value after it lags the fleet

    @classmethod
    def of(cls, switches: list[float]) -> Wave:
        """From each host's switch (``math.inf``: never)."""
        ordered = sorted(switches)
        first, fleet = ordered[0], ordered[len(ordered) // 2]
        return cls(first, fleet, fleet + (fleet - first) if fleet < math.inf else math.inf)

    def change(self, switch: float, position: float) -> str | None:
        """A host switching at ``switch`` against the fleet at ``position``: None (the same value),
        ``"expected"`` (ahead of the fleet, or behind it within the wave) or ``"lagging"``."""
        ahead, behind = switch <= position < self.fleet, self.fleet <= position < switch
        if ahead or (behind and position < self.until):
            return "expected"
        return "lagging" if behind else None


@dataclass(frozen=True)
class NodeConfig:
    """One simulated node and the faults placed on it."""

    index: int
    host: str
    index_rebuilt_at: float = 0.05  # the hosts move from v41 to v42 here; a lagging node later
    index_wave: Wave | None = None  # the rebuild across the fleet (plan() fills it in)
    cache_key_has_version: bool = True
    small_context_from: float | None = None  # restarted with a smaller maximum context
    tree_algorithm_from: float | None = None  # NCCL_ALGO=Tree set on a restart
    batch_burst: tuple[float, float] | None = None  # co-batched load spike: batch sizes 16-48
    nic_timeouts: tuple[float, float, float] | None = None  # (from, to, probability per request)
    xid_at: float | None = None  # XID 48 (double-bit ECC) on GPU 0; weights corrupted until the GPU is reset
    xid_corrupts_requests: int = 6
    template_from: float = 1.0  # this host switches to the new context template here
    template_wave: Wave | None = None  # the template's rollout across the fleet (plan() fills it in)
    restarted_weights_from: float | None = None  # the GPU restarted from an older weight step
    tp_remote_host: str | None = None  # TP ranks 2-3 run on this host (ranks 0-1 on the node's own)
    remote_seq_errors: tuple[float, float, float] | None = None  # on the remote host's NIC: (from, to, probability)
    shared_gpu: bool = False  # MPS replicas on every GPU, GPU 3 held by two pods: the scheduler's double count
    gpu_model: str = REFERENCE_GPU_MODEL
    other_backend: tuple[float, float] | None = None  # the engine ran another attention backend over this span

    def attention_backend(self, position: float) -> str:
        other = self.other_backend is not None and self.other_backend[0] <= position < self.other_backend[1]
        return OTHER_ATTENTION_BACKEND if other else REFERENCE_ATTENTION_BACKEND

    def index_version(self, position: float) -> str:
        return NEW_INDEX if position >= self.index_rebuilt_at else OLD_INDEX

    def fleet_index_version(self, position: float) -> str:
        """The index most hosts run at ``position``: the reference."""
        return NEW_INDEX if position >= self.index_wave.fleet else OLD_INDEX

    def index_change(self, position: float) -> str | None:
        return self.index_wave.change(self.index_rebuilt_at, position)

    def max_context_tokens(self, position: float) -> int:
        small = self.small_context_from is not None and position >= self.small_context_from
        return SMALL_CONTEXT_TOKENS if small else REFERENCE_CONTEXT_TOKENS

    def template(self, position: float) -> str:
        return NEW_TEMPLATE if position >= self.template_from else OLD_TEMPLATE

    def fleet_template(self, position: float) -> str:
        """The template most hosts run at ``position``: the reference."""
        return NEW_TEMPLATE if position >= self.template_wave.fleet else OLD_TEMPLATE

    def template_change(self, position: float) -> str | None:
        return self.template_wave.change(self.template_from, position)

    def weights_step(self, position: float) -> int:
        restarted = self.restarted_weights_from is not None and position >= self.restarted_weights_from
        return RESTARTED_WEIGHTS_STEP if restarted else FLEET_WEIGHTS_STEP

    def algorithm(self, position: float) -> str:
        return "tree" if self.tree_algorithm_from is not None and position >= self.tree_algorithm_from else "ring"

    def in_burst(self, position: float) -> bool:
        return self.batch_burst is not None and self.batch_burst[0] <= position < self.batch_burst[1]

    def in_seq_error_window(self, position: float) -> bool:
        window = self.remote_seq_errors
        return window is not None and window[0] <= position < window[1]


# Fault roles; role r goes to node r % nodes, so every role exists on any cluster of two or more nodes.
_ROLES = (
    {"batch_burst": (0.40, 0.55), "nic_timeouts": (0.60, 0.95, 0.15)},
    {"cache_key_has_version": False, "xid_at": 0.80, "tp_remote_host": "", "remote_seq_errors": (0.30, 0.40, 0.2)},
    {"small_context_from": 0.50, "restarted_weights_from": 0.85},
    {"index_rebuilt_at": 0.25, "tree_algorithm_from": 0.85},
    {"other_backend": (0.10, 0.30)},
)


def remote_host(nodes: int) -> str:
    """The host of the TP ranks 2-3 of the node with role 1: named after the nodes, serving no requests."""
    return f"gpu-node-{nodes + 1:02d}"


def rollout_order(nodes: int) -> list[int]:
    """The order in which hosts get the new template: by index, except that the node restarted with a
    smaller context is the one whose switch makes it most hosts, so it never runs another template than
    the fleet (a request there is never both an expected change and a small-context fault), and node 0,
    whose burst ends just before and whose NIC timeouts begin just after the wave, comes last."""
    small = next(r for r, fields in enumerate(_ROLES) if "small_context_from" in fields) % nodes
    order = [i for i in range(1, nodes) if i != small] + ([0] if small != 0 else [])
    order.insert(nodes // 2, small)
    return order


def _template_switches(nodes: int) -> list[float]:
    order = rollout_order(nodes)
    ahead, behind = order[: nodes // 2], order[nodes // 2 + 1 :]
    switches = [FLEET_SWITCH] * nodes
    for j, node in enumerate(ahead):
        switches[node] = AHEAD_SWITCH[0] + (AHEAD_SWITCH[1] - AHEAD_SWITCH[0]) * j / max(len(ahead) - 1, 1)
    for j, node in enumerate(behind):
        switches[node] = BEHIND_SWITCH[0] + (BEHIND_SWITCH[1] - BEHIND_SWITCH[0]) * (j + 1) / len(behind)
    return switches


def observed(plan: list[NodeConfig], positions: dict[int, list[float]]) -> list[NodeConfig]:
    """The plan with its waves as the requests show them (``positions``: each node's, in order): a host
    switches with its first request at or after its switch, and the fleet moves with the first request
    of the host whose switch made it most hosts."""

    def first_at(node: int, at: float) -> float:
        return next((p for p in positions.get(node, ()) if p >= at), math.inf)

    index_wave = Wave.of([first_at(c.index, c.index_rebuilt_at) for c in plan])
    template_wave = Wave.of([first_at(c.index, c.template_from) for c in plan])
    return [replace(c, index_wave=index_wave, template_wave=template_wave) for c in plan]


def plan(nodes: int) -> list[NodeConfig]:
    settings: list[dict] = [{} for _ in range(nodes)]
    for role, fields in enumerate(_ROLES):
        settings[role % nodes].update(fields)
    template_from = _template_switches(nodes)
    rebuilt_at = [fields.get("index_rebuilt_at", NodeConfig.index_rebuilt_at) for fields in settings]
    index_wave, template_wave = Wave.of(rebuilt_at), Wave.of(template_from)
    for i, fields in enumerate(settings):
        fields.update(template_from=template_from[i], template_wave=template_wave, index_wave=index_wave)
        if "tp_remote_host" in fields:
            fields["tp_remote_host"] = remote_host(nodes)
    settings[-1].update(shared_gpu=True, gpu_model=OTHER_GPU_MODEL)
    return [NodeConfig(i, f"gpu-node-{i + 1:02d}", **settings[i]) for i in range(nodes)]
