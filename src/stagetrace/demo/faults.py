"""The faults the demo injects, as data: which node, when (as a fraction of the run), and what they do.

Each fault is named by the cause a correct explanation would rank first: the span attribute that
changed, or the hardware counter that rose. The reference pipeline every request would otherwise
follow: index ``v42``, a cache keyed by document revision, a 2,048-token context budget, ring
all-reduce, batch-invariant decoding, healthy GPUs and NICs.
"""

from __future__ import annotations

from dataclasses import dataclass

from stagetrace.demo.world import NEW_INDEX, OLD_INDEX

REFERENCE_CONTEXT_TOKENS = 2048
SMALL_CONTEXT_TOKENS = 640  # one node served with less context than the model has, like 65,536 of 262,144

# stage → {fault → the cause it is recorded under}
CAUSES = {
    "retrieval": {"stale_index": "retrieval.index.version"},
    "cache": {"unversioned_cache_key": "cache.entry.index_version"},
    "context_assembly": {"small_context": "context.max_tokens"},
    "allreduce": {"tree_algorithm": "allreduce.algorithm", "nic_timeout": "rdma_local_ack_timeout_err_total"},
    "decode": {"gpu_xid": "gpu_xid_errors_total", "batch_variance": "decode.batch_size"},
}


@dataclass(frozen=True)
class NodeConfig:
    """One simulated node and the faults placed on it."""

    index: int
    host: str
    index_rebuilt_at: float = 0.05  # the fleet moves from v41 to v42 here; a lagging node later
    cache_key_has_version: bool = True
    small_context_from: float | None = None  # restarted with a smaller maximum context
    tree_algorithm_from: float | None = None  # NCCL_ALGO=Tree set on a restart
    batch_burst: tuple[float, float] | None = None  # co-batched load spike: batch sizes 16-48
    nic_timeouts: tuple[float, float, float] | None = None  # (from, to, probability per request)
    xid_at: float | None = None  # XID 48 (double-bit ECC) on GPU 0; weights corrupted until the GPU is reset
    xid_corrupts_requests: int = 6

    def index_version(self, position: float) -> str:
        return NEW_INDEX if position >= self.index_rebuilt_at else OLD_INDEX

    def max_context_tokens(self, position: float) -> int:
        small = self.small_context_from is not None and position >= self.small_context_from
        return SMALL_CONTEXT_TOKENS if small else REFERENCE_CONTEXT_TOKENS

    def algorithm(self, position: float) -> str:
        return "tree" if self.tree_algorithm_from is not None and position >= self.tree_algorithm_from else "ring"

    def in_burst(self, position: float) -> bool:
        return self.batch_burst is not None and self.batch_burst[0] <= position < self.batch_burst[1]


# Fault roles; role r goes to node r % nodes, so every role exists on any cluster of two or more nodes.
_ROLES = (
    {"batch_burst": (0.40, 0.55), "nic_timeouts": (0.60, 0.95, 0.15)},
    {"cache_key_has_version": False, "xid_at": 0.80},
    {"small_context_from": 0.50},
    {"index_rebuilt_at": 0.25, "tree_algorithm_from": 0.85},
)


def plan(nodes: int) -> list[NodeConfig]:
    settings: list[dict] = [{} for _ in range(nodes)]
    for role, fields in enumerate(_ROLES):
        settings[role % nodes].update(fields)
    return [NodeConfig(i, f"gpu-node-{i + 1:02d}", **settings[i]) for i in range(nodes)]
