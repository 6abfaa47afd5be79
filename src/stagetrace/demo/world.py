"""The demo's data and model, built identically in every process from the seed.

A corpus of topical documents with a NumPy vector index (feature-hashed bag-of-words embeddings,
no model download), its rebuilt version with some documents edited, and a tiny recurrent
language model split into tensor-parallel shards, whose weights move a little with every training
step (RL serving pushes them after each). Everything is float32 and deterministic: the same inputs
give bit-identical outputs on every node unless something in the path differs, except for the
tenant that samples at a temperature without a seed, whose outputs differ by design.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

OLD_INDEX, NEW_INDEX = "v41", "v42"
EMBED_DIM = 64
TOPICS, WORDS_PER_TOPIC = 24, 20
DOCS = 600
EDITED_FRACTION = 0.10  # documents whose text (and revision) changes in the rebuild
ADDED_DOCS = 20
TP_SIZE = 4
HIDDEN = 128
CONTEXT_DIM = 256  # split across the TP ranks: each rank owns CONTEXT_DIM // TP_SIZE input columns
OUTPUT_VOCAB = 512
NEW_TOKENS = 40
GAIN = 7.0  # recurrent gain: large enough that a low-order-bit difference reaches the tokens within NEW_TOKENS
MODEL_NAME = "tiny-rnn-demo"
FLEET_WEIGHTS_STEP = 1200  # the training step whose weights the fleet serves
WEIGHTS_DRIFT_PER_STEP = 2e-5  # relative size of one training step's change to the recurrent matrix
UNSEEDED_EVERY = 8  # one in this many distinct inputs belongs to the tenant that samples without a seed
UNSEEDED_TEMPERATURE = 0.8
# the fleet's attention backend, and another whose kernel splits the recurrent step's reduction into more chunks,
# summed last to first
REFERENCE_ATTENTION_BACKEND, OTHER_ATTENTION_BACKEND = "FLASH_ATTN", "FLASHINFER"
OTHER_BACKEND_CHUNKS = 4

_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "do", "ge", "hu", "ji", "fe", "bo"]


def _word(n: int) -> str:
    out = []
    for _ in range(3):
        out.append(_SYLLABLES[n % len(_SYLLABLES)])
        n //= len(_SYLLABLES)
    return "".join(out)


VOCABULARY = [_word(i) for i in range(TOPICS * WORDS_PER_TOPIC + 200)]


def _bucket(word: str, buckets: int) -> tuple[int, float]:
    # a stable hash (Python's hash() differs between processes)
    h = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")
    return h % buckets, 1.0 if (h >> 40) & 1 else -1.0


def embed(text: str) -> np.ndarray:
    """Feature-hashed bag-of-words, L2-normalised float32."""
    v = np.zeros(EMBED_DIM, np.float32)
    for word in text.split():
        i, sign = _bucket(word, EMBED_DIM)
        v[i] += sign
    norm = float(np.linalg.norm(v))
    return v / norm if norm else v


@dataclass(frozen=True)
class Doc:
    id: int
    revision: int
    text: str


def _doc_text(rng: np.random.Generator, topic: int) -> str:
    length = int(rng.integers(20, 111))
    own = VOCABULARY[topic * WORDS_PER_TOPIC : (topic + 1) * WORDS_PER_TOPIC]
    words = [
        own[int(rng.integers(len(own)))] if rng.random() < 0.75 else VOCABULARY[int(rng.integers(len(VOCABULARY)))]
        for _ in range(length)
    ]
    return " ".join(words)


class VectorIndex:
    """Exact top-k cosine search over the documents of one index version."""

    def __init__(self, version: str, docs: list[Doc]):
        self.version = version
        self.docs = {d.id: d for d in docs}
        self._ids = np.array([d.id for d in docs])
        self._matrix = np.stack([embed(d.text) for d in docs])

    def search(self, query: str, k: int) -> list[list[int]]:
        """``[[doc id, revision], ...]`` best first; ties broken by document ID."""
        scores = self._matrix @ embed(query)
        order = np.lexsort((self._ids, -scores))[:k]
        return [[int(self._ids[i]), self.docs[int(self._ids[i])].revision] for i in order]


def corpora(seed: int) -> dict[str, VectorIndex]:
    """The index before and after the rebuild: some documents edited (new revision), a few added."""
    rng = np.random.default_rng([seed, 1])
    old = [Doc(i, 1, _doc_text(rng, int(rng.integers(TOPICS)))) for i in range(DOCS)]
    new = list(old)
    for i in rng.choice(DOCS, int(DOCS * EDITED_FRACTION), replace=False):
        new[i] = Doc(int(i), 2, _doc_text(rng, int(rng.integers(TOPICS))))
    new += [Doc(DOCS + j, 1, _doc_text(rng, int(rng.integers(TOPICS)))) for j in range(ADDED_DOCS)]
    return {OLD_INDEX: VectorIndex(OLD_INDEX, old), NEW_INDEX: VectorIndex(NEW_INDEX, new)}


def prompts(seed: int, count: int) -> list[dict]:
    """Distinct request inputs: prompt and sampling parameters.

    Most are greedy and seeded; every ``UNSEEDED_EVERY``-th belongs to a tenant that samples at
    ``UNSEEDED_TEMPERATURE`` and sends no seed (the input has no ``seed`` key).
    """
    rng = np.random.default_rng([seed, 2])
    out = []
    for i in range(count):
        topic = int(rng.integers(TOPICS))
        own = VOCABULARY[topic * WORDS_PER_TOPIC : (topic + 1) * WORDS_PER_TOPIC]
        words = [own[int(rng.integers(len(own)))] for _ in range(int(rng.integers(5, 11)))]
        spec = {
            "prompt": " ".join(words),
            "top_k": 8 if rng.random() < 0.5 else 4,
            "seed": 1000 + i,
            "temperature": 0.0,
            "max_new_tokens": NEW_TOKENS,
            "model": MODEL_NAME,
        }
        if i % UNSEEDED_EVERY == UNSEEDED_EVERY - 1:
            del spec["seed"]
            spec["temperature"] = UNSEEDED_TEMPERATURE
        out.append(spec)
    return out


def unseeded(spec: dict) -> bool:
    """Whether an input samples at a temperature without a seed: its outputs differ by design."""
    return spec["temperature"] > 0 and spec.get("seed") is None


class Model:
    """A tiny recurrent language model: TP-sharded input projection, then greedy decoding.

    ``h0 = sum over ranks of W_in[:, shard] @ x[shard]`` is the all-reduce; decoding runs
    ``h = tanh(A @ h + E[token])`` and ``token = argmax(W_out @ h)``. Its matrix products are
    split-K reductions whose chunk count depends on the batch size, as in real GEMM kernels, so a
    different batch size changes low-order bits, which the recurrence amplifies into other tokens.
    ``A`` is the weights of training step ``FLEET_WEIGHTS_STEP``; each step moves it a little
    (``a_at_step``). With a temperature above zero, tokens are sampled from ``softmax(W_out @ h / T)``.
    """

    def __init__(self, seed: int):
        rng = np.random.default_rng([seed, 3])
        self.context_table = rng.standard_normal((4096, CONTEXT_DIM)).astype(np.float32)
        self.w_in = (rng.standard_normal((HIDDEN, CONTEXT_DIM)) * (4.0 / np.sqrt(CONTEXT_DIM))).astype(np.float32)
        self.a = (rng.standard_normal((HIDDEN, HIDDEN)) * (GAIN / np.sqrt(HIDDEN))).astype(np.float32)
        self.e = (rng.standard_normal((OUTPUT_VOCAB, HIDDEN)) * 0.5).astype(np.float32)
        self.w_out = (rng.standard_normal((OUTPUT_VOCAB, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
        self._step_direction = rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32)  # one training step's update

    def a_at_step(self, step: int) -> np.ndarray:
        """The recurrent matrix as of training step ``step``: ``A`` moved by one small update per step."""
        if step == FLEET_WEIGHTS_STEP:
            return self.a
        scale = np.float32(WEIGHTS_DRIFT_PER_STEP * GAIN / np.sqrt(HIDDEN) * (step - FLEET_WEIGHTS_STEP))
        return (self.a + scale * self._step_direction).astype(np.float32)

    def context_vector(self, context: str) -> np.ndarray:
        rows = [_bucket(w, len(self.context_table))[0] for w in context.split()]
        return self.context_table[rows].mean(axis=0, dtype=np.float32)

    def shard(self, rank: int) -> tuple[slice, np.ndarray]:
        width = CONTEXT_DIM // TP_SIZE
        cols = slice(rank * width, (rank + 1) * width)
        return cols, self.w_in[:, cols]

    def partial(self, rank: int, x: np.ndarray) -> np.ndarray:
        cols, w = self.shard(rank)
        return w @ x[cols]

    def decode(
        self,
        h0: np.ndarray,
        chunks: int,
        a: np.ndarray | None = None,
        temperature: float = 0.0,
        rng: np.random.Generator | None = None,
        backend: str = REFERENCE_ATTENTION_BACKEND,
    ) -> list[int]:
        """Greedy tokens, or with ``temperature`` above zero tokens sampled with ``rng``."""
        a = self.a if a is None else a
        other = backend != REFERENCE_ATTENTION_BACKEND
        step_chunks = max(chunks, OTHER_BACKEND_CHUNKS) if other else chunks
        h = np.tanh(h0)
        tokens = []
        for _ in range(NEW_TOKENS):
            logits = _split_k(self.w_out, h, chunks)
            if temperature > 0:
                p = np.exp((logits - logits.max()) / temperature, dtype=np.float64)
                token = int(rng.choice(OUTPUT_VOCAB, p=p / p.sum()))
            else:
                token = int(np.argmax(logits))
            tokens.append(token)
            h = np.tanh(_split_k(a, h, step_chunks, reverse=other) + self.e[token])
        return tokens

    @staticmethod
    def detokenize(tokens: list[int]) -> str:
        return " ".join(VOCABULARY[t] for t in tokens)


def split_k_chunks(batch_size: int) -> int:
    """Chunks of the reduction dimension a kernel picks for a batch size (batch-invariant up to 8)."""
    return 1 if batch_size <= 8 else 2 if batch_size <= 16 else 4


def _split_k(m: np.ndarray, x: np.ndarray, chunks: int, reverse: bool = False) -> np.ndarray:
    step = m.shape[1] // chunks
    order = range(chunks - 1, -1, -1) if reverse else range(chunks)
    acc = None
    for c in order:
        part = m[:, c * step : (c + 1) * step] @ x[c * step : (c + 1) * step]
        acc = part if acc is None else acc + part
    return acc


def ring_order(partials: list[np.ndarray]) -> np.ndarray:
    """Ring all-reduce: each chunk's sum starts at the next rank and travels once round the ring.

    For chunk c of n ranks the association is ``((p[c+1] + p[c+2]) + ...) + p[c]``.
    """
    n = len(partials)
    chunks = np.array_split(np.arange(partials[0].shape[0]), n)
    out = np.empty_like(partials[0])
    for c, idx in enumerate(chunks):
        acc = partials[(c + 1) % n][idx]
        for step in range(2, n + 1):
            acc = acc + partials[(c + step) % n][idx]
        out[idx] = acc
    return out


def tree_order(partials: list[np.ndarray]) -> np.ndarray:
    """Tree all-reduce: pairwise sums up a binary tree, ``(p0 + p1) + (p2 + p3)``."""
    level = list(partials)
    while len(level) > 1:
        level = [level[i] + level[i + 1] if i + 1 < len(level) else level[i] for i in range(0, len(level), 2)]
    return level[0]


def arrival_order(partials: list[np.ndarray], late_rank: int) -> np.ndarray:
    """Sum in arrival order when one rank's chunk came late (retransmitted): a different association."""
    order = [r for r in range(len(partials)) if r != late_rank] + [late_rank]
    acc = partials[order[0]]
    for r in order[1:]:
        acc = acc + partials[r]
    return acc
