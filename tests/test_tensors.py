"""Tensors as stage content: one digest for NumPy arrays and torch tensors (any dtype, bf16 and fp8 included), the
hash checked against its definition written out in plain Python, the device path's torch ops against the host's
NumPy, and spans that wait for their digests off the caller's thread.

No GPU here: the CUDA path's arithmetic is the same torch ops run on the CPU (``device_lanes``), and what only a GPU
can check (equality on the device, timings, no stream synchronisation) is ``scripts/tensor-check``.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import ml_dtypes
import numpy as np
import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import stagetrace
from stagetrace import completion, tensors
from stagetrace.digest import Folded, digest, framed

MASK = (1 << 64) - 1


# -- the definition, written out from the module docstring, one word at a time
def reference_lanes(data: bytes) -> tuple[int, int]:
    data += b"\0" * (-len(data) % 8)
    a = b = 0
    for i in range(len(data) // 8):
        x = ((int.from_bytes(data[8 * i : 8 * i + 8], "little") * tensors.M1) & MASK) ^ i
        x ^= x >> 33
        x = (x * tensors.C1) & MASK
        x ^= x >> 33
        x = (x * tensors.C2) & MASK
        x ^= x >> 33
        y = (x * tensors.M3) & MASK
        y ^= y >> 32
        a, b = (a + x) & MASK, (b + y) & MASK
    return a, b


def reference_digest(dtype_name: str, shape: tuple, data: bytes) -> str:
    return framed(b"X", tensors.payload(dtype_name, shape, reference_lanes(data)))


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 15, 16, 17, 63, 1000])
def test_host_and_device_paths_compute_the_definition(length):
    data = np.random.default_rng(length).integers(0, 256, length, dtype=np.uint8)
    expected = reference_lanes(data.tobytes())
    assert tensors.host_lanes(tensors.host_words(data)) == expected
    words = tensors.torch_words(torch.from_numpy(data))  # the words the CUDA path reads, by torch ops
    assert tuple(v & MASK for v in tensors.device_lanes(words).tolist()) == expected
    # what the CUDA path does: the first step on the producer's stream, the rest in place on the private copy
    premultiplied = tensors.premultiplied(words)
    assert tuple(v & MASK for v in tensors.device_lanes(premultiplied, premultiplied=True).tolist()) == expected
    assert digest(data) == reference_digest("uint8", (length,), data.tobytes())


def test_chunked_reductions_agree_with_one_pass():
    """Sums modulo 2**64 in any grouping: chunks on the host, chunks on the device, one pass, all the same bits."""
    words = np.random.default_rng(1).integers(0, 2**64, 100_003, dtype=np.uint64)
    whole, signed = tensors.host_lanes(words), torch.from_numpy(words.view(np.int64))
    assert whole == tuple(v & MASK for v in tensors.device_lanes(signed).tolist())
    assert whole == tuple(v & MASK for v in tensors.device_lanes(signed, chunk=4093).tolist())
    head, tail = tensors.host_lanes(words[:50_000]), tensors.host_lanes(words[50_000:], start=50_000)
    assert whole == ((head[0] + tail[0]) & MASK, (head[1] + tail[1]) & MASK)


def test_array_digests_are_pinned():
    """The encoding is a contract between processes, machines, releases and devices."""
    values = np.arange(6, dtype=np.float32)
    assert digest(values) == "302b54abf304722f8fd4aef95bc879c5"
    assert digest(values) == reference_digest("float32", (6,), values.tobytes())


def test_values_that_are_not_arrays_digest_as_before():
    """Pinned from the release before tensors: only arrays changed their encoding."""
    for value, pinned in [
        (None, "e773506b79c6813310428aaa4f684b72"),
        (7, "3daa401b2ff85f7d9292873b17e40d39"),
        (1.5, "0d8dcd8cfb8c3ee9ff0e99752f114b01"),
        ("héllo", "62efa25ce7171bd9a0e45d3cb098c730"),
        (b"raw", "4c0437bb8506234ed6d3a74d17380aa8"),
        ([1, "a", None], "ab83612b43c055cb529dbaf033947810"),
        ({"prompt": "p", "seed": 7}, "5b7ee3dd131d8ff2f6c66eb6d79eff57"),
        ({3, 1, 2}, "284d33bead6b7ae03c04108d6f65fb0e"),
    ]:
        assert digest(value) == pinned, value


# -- the same content wherever it lives
DTYPES = [
    (torch.float32, np.float32),
    (torch.float64, np.float64),
    (torch.float16, np.float16),
    (torch.int8, np.int8),
    (torch.int16, np.int16),
    (torch.int32, np.int32),
    (torch.int64, np.int64),
    (torch.uint8, np.uint8),
    (torch.bool, np.bool_),
    (torch.complex64, np.complex64),
]
SHAPES = [(), (0,), (1,), (5,), (3, 4), (2, 3, 5)]


@pytest.mark.parametrize("torch_dtype, numpy_dtype", DTYPES, ids=[str(t) for t, _ in DTYPES])
def test_a_cpu_tensor_digests_as_its_numpy_twin(torch_dtype, numpy_dtype):
    rng = np.random.default_rng(0)
    for shape in SHAPES:
        values = np.asarray(rng.standard_normal(shape) * 50)  # 0-d: an array (a NumPy float64 scalar is a float)
        array = (values + 1j * values if numpy_dtype is np.complex64 else values).astype(numpy_dtype)
        tensor = torch.from_numpy(np.array(array))
        assert tensor.dtype == torch_dtype
        assert digest(tensor) == digest(array), (torch_dtype, shape)
        assert digest(tensor) == reference_digest(np.dtype(numpy_dtype).name, shape, array.tobytes())
    assert digest(torch.tensor(1.5)) == digest(np.float32(1.5))  # 0-d tensor and NumPy scalar


@pytest.mark.parametrize(
    "torch_dtype, twin",
    [
        (torch.bfloat16, ml_dtypes.bfloat16),
        (torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn),
        (torch.float8_e5m2, ml_dtypes.float8_e5m2),
        (torch.float8_e4m3fnuz, ml_dtypes.float8_e4m3fnuz),
        (torch.float8_e5m2fnuz, ml_dtypes.float8_e5m2fnuz),
    ],
)
def test_bfloat16_and_float8_digest_as_their_ml_dtypes_twins(torch_dtype, twin):
    source = torch.randn(7, 9, generator=torch.Generator().manual_seed(3))
    tensor = source.to(torch_dtype)
    array = source.numpy().astype(twin)
    assert tensor.view(torch.uint8).numpy().tobytes() == array.tobytes()  # the same bytes, as stored
    name = str(torch_dtype).removeprefix("torch.")
    assert np.dtype(twin).name == name
    assert digest(tensor) == digest(array) == reference_digest(name, (7, 9), array.tobytes())
    # the dtype is named: the same bytes as another dtype are other content
    assert digest(tensor) != digest(tensor.view(torch.uint8).view(torch.int8))


def test_bfloat16_and_float16_with_the_same_bytes_differ():
    bits = torch.arange(12, dtype=torch.int16)
    assert digest(bits.view(torch.bfloat16)) != digest(bits.view(torch.float16)) != digest(bits)


def test_views_digest_as_their_contiguous_copies():
    base = torch.randn(6, 8, dtype=torch.float32).to(torch.bfloat16)
    views = (base.t(), base[:, 1::3], base[1:5, 2:7], base[::2], base.unsqueeze(1).expand(6, 3, 8), base[3], base[2, 5])
    for view in views:
        assert not view.is_contiguous() or view.storage_offset() or view.dim() < 2
        assert digest(view) == digest(view.contiguous()) == digest(view.clone())
    assert digest(base.t()) != digest(base)  # a transposed matrix holds its elements in another order
    array = np.arange(40, dtype=np.int16).reshape(5, 8)
    assert digest(array[::-1, ::3]) == digest(np.ascontiguousarray(array[::-1, ::3]))
    assert digest(torch.from_numpy(array)[1:4, ::3]) == digest(array[1:4, ::3])
    assert digest(array.astype(">i2")) == digest(array)  # big-endian storage: the values, not their byte order
    conjugated = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()  # a lazy view of other values
    assert digest(conjugated) == digest(np.array([1 - 2j, 3 + 4j], dtype=np.complex64))


def test_odd_byte_lengths_are_padded_and_still_distinct():
    seen = {}
    for length in range(0, 25):
        array = np.full(length, 7, dtype=np.int8)
        assert digest(torch.from_numpy(array)) == digest(array)
        seen[digest(array)] = length
    assert len(seen) == 25
    # trailing zero bytes are content: the shape says how many bytes there are
    assert digest(np.zeros(3, np.uint8)) != digest(np.zeros(8, np.uint8))


def test_one_element_apart_differ():
    rng = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        base = torch.randn(1 << 16, generator=rng).to(dtype)
        integer = {1: torch.int8, 2: torch.int16, 4: torch.int32}[base.element_size()]
        sign = -(1 << (8 * base.element_size() - 1))
        for index in (0, 1, 777, base.numel() - 1):
            for flip in (1, sign):  # one ulp, then the sign, of one element
                bits = base.clone().view(integer)
                bits[index] ^= flip
                assert digest(bits.view(dtype)) != digest(base), (dtype, index, flip)


def test_the_same_elements_in_another_order_differ():
    base = torch.arange(4096, dtype=torch.float32)
    swapped = base.clone()
    swapped[[10, 11]] = swapped[[11, 10]]
    shuffled = base[torch.randperm(4096, generator=torch.Generator().manual_seed(0))]
    for other in (base.flip(0), base.roll(1), shuffled, swapped):
        assert sorted(other.tolist()) == sorted(base.tolist())
        assert digest(other) != digest(base)
    words = torch.arange(64, dtype=torch.int64)
    assert digest(words.view(8, 8).t().contiguous().view(-1)) != digest(words)
    pairs_swapped = torch.tensor([2, 1, 4, 3], dtype=torch.int16)
    assert digest(torch.tensor([1, 2, 3, 4], dtype=torch.int16)) != digest(pairs_swapped)


def test_arrays_through_dlpack():
    class Producer:
        """A DLPack producer that is neither torch nor NumPy (as CuPy or JAX arrays are)."""

        def __init__(self, tensor):
            self._tensor = tensor

        def __dlpack__(self, **kwargs):
            return self._tensor.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self._tensor.__dlpack_device__()

    tensor = torch.randn(3, 5).to(torch.bfloat16)
    assert digest(Producer(tensor)) == digest(tensor)
    assert digest(Producer(torch.arange(10))) == digest(np.arange(10))


@pytest.mark.parametrize(
    "dtype, row",
    [
        (torch.float32, (64,)),  # rows of whole words: one pass for every group
        (torch.bfloat16, (4, 8)),
        (torch.int64, ()),  # token IDs: a word a row
        (torch.float32, (70_000,)),  # a batch larger than the host's hashing chunk, still one pass
        (torch.float32, (1 << 20,)),  # larger than one pass takes: group by group
        (torch.bfloat16, (3,)),  # 6-byte rows, not whole words: group by group
    ],
)
def test_each_request_of_a_batch_digests_as_its_rows_alone(dtype, row):
    batch = (torch.randn((6, *row), generator=torch.Generator().manual_seed(3)) * 1000).to(dtype)
    groups = [[(0, 2), (4, 5)], [(2, 3)], [(5, 6)]]  # row 3 is nobody's
    alone = [digest(torch.cat([batch[a:b] for a, b in runs])) for runs in groups]
    assert [d.result() for d in tensors.start_rows(batch, groups)] == alone
    if dtype == torch.float32:
        assert [d.result() for d in tensors.start_rows(batch.numpy(), groups)] == alone
    changed = batch.clone()
    changed[2].view(-1)[-1] *= -2  # one element of the second group's row (exact in every dtype here)
    after = [d.result() for d in tensors.start_rows(changed, groups)]
    assert after[0] == alone[0] and after[2] == alone[2] and after[1] != alone[1]


def test_per_row_lanes_on_the_host_and_in_torch_ops_compute_the_definition():
    """Each row hashed from its own first index: the host's NumPy and the torch ops a GPU runs (here on the CPU)
    agree with the definition for the row's words at those indices."""
    rng = np.random.default_rng(9)
    words = rng.integers(0, 2**63, (5, 7), dtype=np.int64).view(np.uint64) * np.uint64(3)  # high bits set too
    bases = np.array([0, 7, 70, 0, 2**40], np.uint64)
    a, b = tensors.host_row_lanes(words, bases)
    for row in range(5):  # the definition's lanes of a row whose first word has index bases[row]
        expected = tensors.host_lanes(words[row], start=int(bases[row]))
        assert (a[row], b[row]) == expected
    lanes = tensors.device_row_lanes(torch.from_numpy(words.view(np.int64)), torch.from_numpy(bases.view(np.int64)))
    assert [[v & MASK for v in side] for side in lanes.tolist()] == [a, b]


def test_row_batches_keep_the_bytes_as_they_were_and_digest_as_each_groups_rows_alone():
    """A decode loop's tensors, kept and hashed later many at a time: each digest is what its rows gave when they
    were added, though the tensor is overwritten in place afterwards (as an all-reduce does to its input)."""
    batches = tensors.RowBatches()
    groups = [[(0, 1), (3, 4)], [(1, 3)]]
    batch = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))
    expected, laters = [], []
    for step in range(5):
        expected.append([digest(torch.cat([batch[a:b] for a, b in runs])) for runs in groups])
        laters.append(batches.add(batch, groups))
        batch.mul_(-1.5).add_(step)  # in place, after it was added
    odd = batches.add(torch.zeros(4, 3, dtype=torch.bfloat16), groups)  # 6-byte rows: started now
    assert [[d.result() for d in step] for step in laters] == expected
    with pytest.raises(ValueError, match="^a 0-dimensional array has no rows to split: digest it whole$"):
        batches.add(torch.tensor(3.0), [[(0, 1)]])
    assert [d.result() for d in odd] == [digest(torch.zeros(2, 3, dtype=torch.bfloat16))] * 2


def test_rows_outside_the_batch_are_a_one_line_error():
    with pytest.raises(ValueError, match=r"^rows 4:9 are not within the batch's 6 rows$"):
        tensors.start_rows(torch.zeros(6, 8), [[(0, 2)], [(4, 9)]])


def test_stagetrace_digests_arrays_without_torch():
    """torch is never a dependency: without it, NumPy arrays and host DLPack producers digest the same."""
    script = (
        "import sys; sys.modules['torch'] = None\n"  # import torch now raises ImportError
        "import numpy as np, stagetrace, stagetrace.tracing, stagetrace.integrations\n"
        "class Producer:\n"
        "    def __init__(self, a): self.a = a\n"
        "    def __dlpack__(self, **kw): return self.a.__dlpack__(**kw)\n"
        "    def __dlpack_device__(self): return self.a.__dlpack_device__()\n"
        "a = np.arange(12, dtype=np.float32).reshape(3, 4)\n"
        "print(stagetrace.digest(a), stagetrace.digest(Producer(a)))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    expected = digest(torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert done.stdout.split() == [expected, expected]


@pytest.mark.parametrize(
    "make, error, says",
    [
        (lambda: torch.empty(3, device="meta"), ValueError, "meta device"),
        (lambda: torch.eye(3).to_sparse(), TypeError, "sparse_coo tensor"),
        (lambda: torch.eye(3).to_sparse_csr(), TypeError, "sparse_csr tensor"),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), TypeError, "nested tensor"),
        (lambda: np.array([object(), 1], dtype=object), TypeError, "Python objects"),
    ],
)
def test_what_the_path_cannot_take_is_a_one_line_error(make, error, says):
    value = make()
    for call in (digest, tensors.start):
        with pytest.raises(error) as raised:
            call(value)
        assert says in str(raised.value) and "\n" not in str(raised.value)
    with pytest.raises(error):
        stagetrace.stage("decode", input=value)


def test_a_tensor_whose_storage_was_freed_is_refused_in_one_line():
    tensor = torch.ones(16)
    tensor.untyped_storage().resize_(0)  # as FSDP frees a parameter's storage
    started = tensors.start(tensor)
    assert isinstance(started, tensors.Failed) and "freed" in started.reason
    with pytest.raises(tensors.DigestUnavailable, match="storage was freed"):
        digest(tensor)


# -- spans
@pytest.fixture
def spans():
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    stagetrace.configure(tracer_provider=provider, record_content=True)
    return memory


def test_stage_content_may_be_a_tensor(spans):
    hidden = torch.randn(2, 8).to(torch.bfloat16)
    with stagetrace.request("r-t", input=torch.tensor([3, 1, 4])) as req:
        with stagetrace.stage("allreduce", input=hidden) as st:
            returned = st.set_output(hidden * 2)
        req.set_output("text")
    got = {s.name: s for s in spans.get_finished_spans()}
    stage = got["stage.allreduce"]
    assert stage.attributes["stagetrace.stage.input_digest"] == digest(hidden)
    assert stage.attributes["stagetrace.stage.output_digest"] == returned == digest(hidden * 2)
    assert got["inference.request"].attributes["stagetrace.input.digest"] == digest(np.array([3, 1, 4]))
    # arrays are digested, never recorded as content, even with content recording on
    assert "stagetrace.stage.input_content" not in stage.attributes
    assert got["inference.request"].attributes["stagetrace.output.content"] == "text"


def test_a_stage_whose_tensor_was_freed_says_so_and_ends(spans):
    freed = torch.ones(4)
    freed.untyped_storage().resize_(0)
    with stagetrace.stage("decode", input=torch.ones(2)) as st:
        st.set_output(freed)
    (span,) = spans.get_finished_spans()
    assert "stagetrace.stage.output_digest" not in span.attributes
    assert "storage was freed" in span.attributes[completion.DIGEST_ERROR]
    assert span.attributes["stagetrace.stage.input_digest"] == digest(torch.ones(2))


class Later:
    """A value that a device would finish later: ready once ``release`` is called (no torch involved)."""

    def __init__(self, value: str):
        self.value, self._ready = value, threading.Event()

    def release(self):
        self._ready.set()

    def done(self) -> bool:
        return self._ready.is_set()

    def result(self):
        return self.value


def test_pending_digests_complete_the_span_later_with_its_own_end_time(spans):
    """What the CUDA path does with its events: the stage ends when the caller leaves it, the span when the digest
    is ready, off the caller's thread, with the stage's end time."""
    later = Later("ab" * 16)
    with stagetrace.stage("decode", input="x") as st:
        st._pending["stagetrace.stage.output_digest"] = later  # as set_output does for a GPU tensor
    left_at = time.time_ns()
    assert spans.get_finished_spans() == ()  # not ended yet: its digest is still on the device
    time.sleep(0.05)
    later.release()
    assert stagetrace.flush(5_000)
    (span,) = spans.get_finished_spans()
    assert span.attributes["stagetrace.stage.output_digest"] == "ab" * 16
    assert span.end_time <= left_at  # the stage's own end, not when the digest came


def test_at_exit_a_span_still_waiting_ends_saying_why():
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    span = provider.get_tracer("t").start_span("stage.decode")
    completer = completion.Completer()
    never = Later("never")
    completer.submit(span, {"stagetrace.stage.output_digest": never, "other": tensors.Ready("x")}, time.time_ns())
    completer.close(wait_s=0.1)  # what runs at interpreter exit
    (ended,) = memory.get_finished_spans()
    assert "process exited" in ended.attributes[completion.DIGEST_ERROR]
    assert ended.attributes["other"] == "x" and "stagetrace.stage.output_digest" not in ended.attributes


def test_a_failed_device_value_is_recorded_not_raised():
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    span = provider.get_tracer("t").start_span("stage.allreduce")
    failed = tensors.Failed("the device failed before the digest was ready (RuntimeError: CUDA error: illegal address)")
    folded = Folded([tensors.Ready("a" * 32), failed])
    completion.submit(span, {"stagetrace.stage.output_digest": folded}, time.time_ns())
    (ended,) = memory.get_finished_spans()
    assert "CUDA error" in ended.attributes[completion.DIGEST_ERROR]


def test_folded_digests_are_the_digest_of_the_parts_in_order():
    parts = [tensors.start(torch.full((3,), float(i))) for i in range(4)]
    folded = Folded(parts)
    assert folded.done() and folded.result() == digest([digest(torch.full((3,), float(i))) for i in range(4)])
    assert folded.result() != Folded(parts[::-1]).result()
