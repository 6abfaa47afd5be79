"""The frame every content digest ends in: BLAKE2b-128 over a type tag, the payload's length and the payload.

``stagetrace.digest`` frames plain values and ``stagetrace.tensors`` frames an array's lanes with it, so a value and
an array nested in it are hashed by one rule. It sits below both: neither imports the other to reach it.
"""

from __future__ import annotations

import hashlib
import struct

DIGEST_BYTES = 16


def framed(tag: bytes, payload: bytes) -> str:
    """The hex digest of one frame: what ``digest`` gives for a value whose encoding is ``tag`` and ``payload``."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    frame(h, tag, payload)
    return h.hexdigest()


def frame(h, tag: bytes, payload: bytes) -> None:
    """Feed one frame to the hash ``h``: the tag, the payload's length (8 bytes, big-endian), the payload."""
    h.update(tag)
    h.update(struct.pack(">Q", len(payload)))
    h.update(payload)
