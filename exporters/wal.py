"""The write-ahead log: OTLP requests fsynced as they arrived, before they are answered, stored in groups.

The OTLP receivers write each request as it arrived (protobuf), named ``<seq>.<record kind>.<rows>.<request
token>.wal``, fsynced before the request is answered. The writer's replay thread turns the oldest records into rows
and inserts them together, so many small requests make one insert; before that insert it *seals* them as a group
(renames each to ``….<request token>.<group token>.wal``), and the group's token is the insert's deduplication
token, so a replay after a crash inserts the same group under the same token and adds nothing. The tokens of the
requests stored are remembered (``exporters.landed``), so a sender's retry of a request whose answer it never got is
recognised and not stored twice. Records are never dropped to make room: a full spool refuses the request (the
sender retries). Stored records are kept a while (``exporters.kept``) to restore a part the engine loses.

**Groups sealed by an earlier process** (found sealed at start or adopted) may have been stored already: their
insert fsyncs the part, but neither the engine's deduplication log (which the token relies on) nor the records'
removal is fsynced, so a power cut or a filesystem that turns read-only (its journal aborted) can forget both.
``head_group`` says so (``inherited``), and the writer stores only the rows the table does not hold yet.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import replace
from pathlib import Path

from stagetrace.environment_variables import STAGETRACE_SPOOL_MAX_BYTES
from stagetrace.exporters.diskspace import Spell
from stagetrace.exporters.kept import KEPT, KeptRecords
from stagetrace.exporters.landed import LandedTokens
from stagetrace.exporters.segments import Segment, SegmentQueue, new_token, write_atomically

logger = logging.getLogger("stagetrace.exporters.spool")  # the spool's lines, as before the split


def pending_records(base: Path) -> list[Segment]:
    """The write-ahead records under ``base`` (a spool's ``<directory>/<kind>``) not stored yet, or stored and not
    yet retired, in every slot, oldest first."""
    pending = []
    for slot in sorted(Path(base).glob("*/")):
        if slot.name == KEPT:
            continue
        with contextlib.suppress(OSError):
            for entry in os.scandir(slot):
                segment = Segment.named(Path(entry.path), 0) if entry.name.endswith(".wal") else None
                if segment is not None:
                    pending.append(segment)
    return sorted(pending, key=lambda s: s.path.name)


class WriteAheadLog(SegmentQueue):
    """The write-ahead records in ``directory``, in the queue they share with the spool's batches; stored ones are
    moved into ``kept`` (None: deleted)."""

    def __init__(self, directory: Path, max_bytes: int, kept: KeptRecords | None = None):
        super().__init__(directory, max_bytes)
        self._tokens = LandedTokens()
        self._kept = kept
        self._refusal: tuple[str, Spell] | None = None  # why requests are being refused, while they are
        self._retire_failing = False  # stored records could not be removed (a read-only disk), said once
        self._sealed_here: set[str] = set()  # groups this process sealed (the others may be stored already)
        self._seal_failing = False

    def known(self, token: str) -> bool:
        """Whether a request with ``token`` is already durable here: written as a record, or stored."""
        with self._lock:
            return token in self._tokens

    def put_record(self, kind: str, payload: bytes, rows: int, token: str) -> Segment | None:
        """Write one request as received, fsynced; None when the spool is full or the disk refused it. Nothing
        is dropped then: the caller must not acknowledge the request, whose sender retries it."""
        with self._lock:
            if sum(s.size for s in self._segments) + len(payload) > self.max_bytes:
                self._refusing(
                    "full",
                    logging.WARNING,
                    "spool %s is full (%d bytes): refusing requests until the store takes the backlog (raise %s)",
                    self.directory,
                    self.max_bytes,
                    STAGETRACE_SPOOL_MAX_BYTES,
                )
                return None
            segment = Segment(
                self.directory / f"{self._next_seq():020d}.{kind}.{rows}.{token}.wal", kind, rows, len(payload), token
            )
            try:
                write_atomically(segment.path, payload)
            except OSError as exc:
                self._refusing(
                    "unwritable",
                    logging.ERROR,
                    "spool %s: cannot write requests (%s): refusing them until it can",
                    self.directory,
                    exc.strerror or exc,
                )
                return None
            self._segments.append(segment)
            self._tokens.remember(token)
            self._taking()
        return segment

    def _refusing(self, why: str, level: int, message: str, *args) -> None:
        """A request refused: the first of a spell is logged, the others counted (never a line per request)."""
        if self._refusal is not None and self._refusal[0] != why:
            self._taking()  # from full to unwritable, or back: each spell its own pair of lines
        if self._refusal is None:
            self._refusal = (why, Spell(logger))
            self._refusal[1].begin(level, message, *args)
        self._refusal[1].refused += 1

    def _taking(self) -> None:
        if self._refusal is not None:
            why, spell = self._refusal
            self._refusal = None
            lasted, refused = spell.end()
            state = "full" if why == "full" else "its disk refused writes"
            logger.warning(
                "spool %s takes requests again after %.1f s (%s meanwhile: refused %d requests)",
                self.directory,
                lasted,
                state,
                refused,
            )

    def head_group(self, max_rows: int) -> tuple[str, list[Segment]]:
        """The group of write-ahead records at the head of the spool, and its token: a group sealed earlier
        (whole, or what is left of it after a crash), else the oldest records of one kind up to ``max_rows``,
        sealed now. Empty when the head is a batch, or sealing failed."""
        with self._lock:
            head = self._segments[0] if self._segments else None
            if head is None or not head.record:
                return "", []
            if head.group:
                return head.group, [s for s in self._segments if s.group == head.group]
            group, members, rows = new_token(), [], 0
            for i, segment in enumerate(self._segments):
                if not segment.record or segment.group or segment.table != head.table:
                    break
                if members and rows + segment.rows > max_rows:
                    break
                sealed = replace(
                    segment, path=segment.path.with_name(f"{segment.path.name[:-4]}.{group}.wal"), group=group
                )
                try:
                    os.rename(segment.path, sealed.path)
                except OSError as exc:
                    if not self._seal_failing:  # the replay retries with back-off: one line until it works
                        logger.error(
                            "spool %s: cannot seal %s: %s", self.directory, segment.path.name, exc.strerror or exc
                        )
                    self._seal_failing = True
                    break
                self._seal_failing = False
                self._sealed_here.add(group)
                self._segments[i] = sealed
                members.append(sealed)
                rows += segment.rows
            return (group, members) if members else ("", [])

    def inherited(self, group: str) -> bool:
        """Whether ``group`` was sealed by an earlier process, so that its rows may be in the store already."""
        with self._lock:
            return group not in self._sealed_here

    def read_record(self, segment: Segment) -> bytes | None:
        """A record's request; None (and the record dropped and counted) when it cannot be read."""
        try:
            return segment.path.read_bytes()
        except OSError as exc:
            self.unreadable(segment, exc)
            return None

    def landed(self, members: list[Segment]) -> None:
        """The records of a group are in the store: remember their tokens (a sender's retry), then keep them
        (``exporters.kept``) or remove them. A disk that refuses (read-only) leaves them where they are: the next
        process finds the group sealed by another and stores only what the store lacks."""
        with self._lock:
            try:
                self._tokens.stored([s.token for s in members])
                for segment in members:
                    self._retire(segment)
            except OSError as exc:
                if not self._retire_failing:
                    logger.error(
                        "spool %s: cannot remove records already stored (%s): they stay, and are checked "
                        "against the store when the spool is next opened",
                        self.directory,
                        exc.strerror or exc,
                    )
                self._retire_failing = True
            else:
                if self._retire_failing:
                    logger.warning("spool %s: stored records are removed again", self.directory)
                self._retire_failing = False
            for segment in members:
                if segment in self._segments:
                    self._segments.remove(segment)
                self._sealed_here.discard(segment.group)
            if self._kept is not None:
                self._kept.trim()

    def _retire(self, segment: Segment) -> None:
        if self._kept is None or not self._kept.keep_bytes or not segment.group:
            self._discard(segment)
        else:
            self._kept.keep(segment)


__all__ = ["WriteAheadLog", "pending_records"]
