"""sysfs attribute files read with one system call each: held open between scrapes, read with ``pread`` at 0.

A sysfs attribute makes its text anew on every read from offset 0 (kernfs' seq_file calls the driver's
``show()`` again), so a collector that keeps the file open reads a counter with one ``pread``, where ``open``,
``read`` and ``close`` take three and the kernel walks the path through sysfs' symlinks each time. A file
rewritten in place, as a fixture tree is, reads anew the same way.

Each directory is checked with one ``stat`` a scrape: when its inode or its modification time changed its
files are opened anew. A driver reload or a replaced device makes new directories (new inodes); a fixture tree's
directory changes its modification time when a file is added, removed or renamed into it. A held file that the
kernel removed reads as an error, which is None. Descriptors are held while the process has plenty to spare (a
quarter of its open-file limit, which :func:`raise_open_file_limit` first raises to the hard limit, as Go
programs such as node_exporter do at start); beyond that, files are read with ``open``, ``read`` and ``close``.
"""

from __future__ import annotations

import os
import resource
import threading
import weakref
from collections.abc import Callable, Iterable

_lock = threading.Lock()
_held_total = 0  # descriptors held by every HeldFiles of the process
_budget: int | None = None


def raise_open_file_limit() -> int:
    """Raise the soft open-file limit to the hard one (at most 2**16); the soft limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard if hard != resource.RLIM_INFINITY else 1 << 16, 1 << 16)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass  # a container may forbid it: hold fewer files
    return soft


def _take(count: int) -> bool:
    """Reserve ``count`` descriptors to hold, if the budget allows."""
    global _held_total, _budget
    with _lock:
        if _budget is None:
            _budget = raise_open_file_limit() // 4
        if _held_total + count > _budget:
            return False
        _held_total += count
        return True


def _give_back(count: int) -> None:
    global _held_total
    with _lock:
        _held_total -= count


def read_once(name: str, dir_fd: int | None = None) -> str | None:
    """The file's text, stripped, with ``open``, ``read`` and ``close``; None for a file that is missing or that
    the driver refuses to read (EINVAL, EOPNOTSUPP, EIO: what a driver answers for a counter it cannot read)."""
    try:
        fd = os.open(name, os.O_RDONLY, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        return os.read(fd, 4096).decode("ascii", "replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)


class _Directory:
    __slots__ = ("identity", "files", "held")

    def __init__(self, identity: tuple, files: dict[str, int | None], held: bool):
        self.identity = identity
        self.files = files  # name -> descriptor (None: the file did not open, or the budget held no more)
        self.held = held


def _close(entry: _Directory) -> None:
    if entry.held:
        fds = [fd for fd in entry.files.values() if fd is not None]
        for fd in fds:
            os.close(fd)
        _give_back(len(fds))


def _release(directories: dict[str, _Directory]) -> None:
    while directories:
        _close(directories.popitem()[1])


class HeldFiles:
    """The files of some directories, held open between calls of :meth:`read`; :meth:`close` releases them."""

    def __init__(self):
        self._directories: dict[str, _Directory] = {}
        # a collector dropped without close() (a test's, a rebuilt node's) must not keep its descriptors
        self._finalizer = weakref.finalize(self, _release, self._directories)

    def read(
        self, directory: str, names: Iterable[str] | None = None, keep: Callable[[str], bool] = lambda name: True
    ) -> dict[str, str | None]:
        """``{name: text}`` of ``directory``'s files: ``names``, else every file ``keep`` accepts, in name order.
        A file that is missing or that the driver refuses reads None; a directory that is not there gives {}."""
        try:
            st = os.stat(directory)
        except OSError:
            self.forget(directory)
            return {}
        identity = (st.st_dev, st.st_ino, st.st_mtime_ns)
        held = self._directories.get(directory)
        if held is None or held.identity != identity:
            self.forget(directory)
            held = self._open(directory, identity, names, keep)
            if held is None:
                return {}
        if not held.held:
            return self._read_unheld(directory, held.files)
        texts = {}
        for name, fd in held.files.items():
            if fd is None:
                texts[name] = None
                continue
            try:
                texts[name] = os.pread(fd, 4096, 0).decode("ascii", "replace").strip()
            except OSError:
                texts[name] = None  # the driver refuses now; it may answer at a later scrape
        return texts

    def _open(self, directory: str, identity: tuple, names, keep) -> _Directory | None:
        try:
            dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return None
        try:
            if names is None:
                try:
                    names = sorted(name for name in os.listdir(dir_fd) if keep(name))
                except OSError:
                    return None  # listed again at the next read
            names = tuple(names)
            if not _take(len(names)):
                entry = _Directory(identity, dict.fromkeys(names), held=False)
            else:
                files: dict[str, int | None] = {}
                for name in names:
                    try:
                        files[name] = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
                    except OSError:
                        files[name] = None
                _give_back(sum(fd is None for fd in files.values()))
                entry = _Directory(identity, files, held=True)
        finally:
            os.close(dir_fd)
        self._directories[directory] = entry
        return entry

    @staticmethod
    def _read_unheld(directory: str, files: dict[str, int | None]) -> dict[str, str | None]:
        try:
            dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return {}
        try:
            return {name: read_once(name, dir_fd) for name in files}
        finally:
            os.close(dir_fd)

    def forget(self, directory: str) -> None:
        """Release ``directory``'s files: the next :meth:`read` opens them anew."""
        entry = self._directories.pop(directory, None)
        if entry is not None:
            _close(entry)

    def forget_except(self, directories: set[str]) -> None:
        """Release the directories not in ``directories`` (ports that are gone)."""
        for directory in [d for d in self._directories if d not in directories]:
            self.forget(directory)

    def close(self) -> None:
        _release(self._directories)
