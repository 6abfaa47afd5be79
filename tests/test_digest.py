import dataclasses
import hashlib

import numpy as np
import pytest

from stagetrace import digest


def test_digest_is_short_hex_and_stable_across_processes():
    d = digest({"prompt": "why is the sky blue?", "seed": 7, "temperature": 0.0})
    assert len(d) == 32 and int(d, 16) >= 0
    assert d == digest({"temperature": 0.0, "seed": 7, "prompt": "why is the sky blue?"})
    # the encoding is a contract between processes, machines and releases: tag, 8-byte big-endian length, payload
    frame = b"S" + len("héllo".encode()).to_bytes(8, "big") + "héllo".encode()
    assert digest("héllo") == hashlib.blake2b(frame, digest_size=16).hexdigest()


@pytest.mark.parametrize(
    "a, b",
    [
        (1, 1.0),
        (1, True),
        (1, "1"),
        (None, ""),
        ([1, 2], [2, 1]),
        (["ab"], ["a", "b"]),
        ("a", b"a"),
        ({"a": 1}, [["a", 1]]),
        (0.0, -0.0),
        ((1,), [1, None]),
        ({"k": [1]}, {"k": [1.0]}),
    ],
)
def test_different_content_gives_different_digests(a, b):
    assert digest(a) != digest(b)


def test_equal_content_gives_equal_digests():
    assert digest([1, 2]) == digest((1, 2))
    assert digest({1, 2, 3}) == digest({3, 2, 1})
    assert digest(float("nan")) == digest(float("-nan"))


def test_arrays_digest_their_dtype_shape_and_bytes():
    a = np.arange(6, dtype=np.float32)
    assert digest(a) == digest(np.arange(6, dtype=np.float32))
    assert digest(a) != digest(a.astype(np.float64))
    assert digest(a) != digest(a.reshape(2, 3))
    b = a.copy()
    b[5] = np.nextafter(b[5], np.float32(10))  # one ulp: the low-order-bit change batch size can cause
    assert digest(a) != digest(b)


def test_dataclasses_and_unsupported_types():
    @dataclasses.dataclass
    class Sampling:
        seed: int
        temperature: float

    assert digest(Sampling(7, 0.0)) == digest(Sampling(7, 0.0)) != digest(Sampling(8, 0.0))
    with pytest.raises(TypeError, match="cannot digest a object"):
        digest(object())
