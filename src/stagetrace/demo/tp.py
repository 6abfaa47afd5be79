"""Tensor-parallel ranks as real processes exchanging float32 partial results over pipes.

Rank 0 is the node's own process; ranks 1..n-1 are children (forked, so they start with the model) that compute with their shard of the input
projection. For each request rank 0 sends the context vector, every rank computes its partial
product, the partials travel back, rank 0 reduces them in the order the algorithm defines and sends
the sum to every rank, as an all-reduce leaves it on all of them.
"""

from __future__ import annotations

import multiprocessing as mp

import numpy as np

from stagetrace.demo.world import TP_SIZE, Model


def _rank_main(rank: int, model: Model, conn, inherited) -> None:
    # The node's ends of this rank's pipe and of the ranks forked before it came along with the fork: closed, so that
    # when the node process ends (an interrupted demo stops it) every rank reads end-of-file and ends, instead of
    # each holding the others' pipes open and all of them waiting for ever.
    for other in inherited:
        other.close()
    try:
        while True:
            x = conn.recv()
            if x is None:
                return
            conn.send(model.partial(rank, x))
            conn.recv()  # the reduced result
    except (EOFError, OSError):  # the node process was stopped (an interrupted demo): end quietly, as it did
        return


class TPGroup:
    """The node's TP group; ``partials(x)`` runs the exchange and returns every rank's partial."""

    def __init__(self, model: Model):
        ctx = mp.get_context("fork")
        self.model = model
        self._conns = []
        self._procs = []
        for rank in range(1, TP_SIZE):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, model, child, [parent, *self._conns]),
                daemon=True,
                name=f"tp-rank-{rank}",
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)

    def partials(self, x: np.ndarray) -> list[np.ndarray]:
        for conn in self._conns:
            conn.send(x)
        return [self.model.partial(0, x)] + [conn.recv() for conn in self._conns]

    def finish(self, reduced: np.ndarray) -> None:
        for conn in self._conns:
            conn.send(reduced)

    def close(self) -> None:
        for conn in self._conns:
            conn.send(None)
        for proc in self._procs:
            proc.join(timeout=5)
