"""Storage faults: the filesystem under the agent's store and spool turns read-only mid-stream.

An administrator's ``mount -o remount,ro`` is refused (EBUSY) while any file on the filesystem is open for writing,
and the embedded engine always holds some (its ``status`` file, each table's deduplication log): so the read-only
remount an agent meets while it runs is the kernel's own, on an I/O error under ``errors=remount-ro``. The test
makes that happen: an ext4 image on a loop device (root, which CI has; elsewhere the test skips with the reason, and
under ``CI=true`` it fails), mounted ``errors=remount-ro``, and ext4's ``trigger_fs_error`` (the kernel's hook for
what a failing disk does: the journal aborts and the filesystem turns read-only) while three senders stream
OTLP/HTTP. The agent must stay up, answer 503 with ``Retry-After`` (never 200 for what it could not make durable),
and say so in a few lines, not one per request. Then, as an operator would: stop the agent, unmount, ``e2fsck``,
mount read-write, start it again: every span answered 200 is in the store exactly once.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from tests.test_agent import wait_for
from tests.agents import unavailable
from tests.test_disk_full import STARTS_AND_STOPS, Agent, Sender, assert_stored_once, spooled


SIZE_MIB = 256
READ_ONLY_FOR_S = 6.0


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.fixture
def ext4_disk(tmp_path):
    """An ext4 filesystem on a loop device, mounted ``errors=remount-ro``; yields (mount point, device)."""
    tools = ("mount", "umount", "losetup", "mkfs.ext4", "e2fsck")
    if os.geteuid() != 0 or not all(shutil.which(t) for t in tools):
        unavailable(f"an ext4 image on a loop device needs root and {', '.join(tools)}")
    image, mounted = tmp_path / "disk.img", tmp_path / "disk"
    mounted.mkdir()
    with image.open("wb") as out:
        out.truncate(SIZE_MIB << 20)
    made = _run("mkfs.ext4", "-q", "-F", str(image))
    if made.returncode != 0:
        unavailable(f"cannot make an ext4 image: {made.stderr.strip()}")
    attached = _run("losetup", "--find", "--show", str(image))
    if attached.returncode != 0:
        unavailable(f"cannot attach a loop device: {attached.stderr.strip()}")
    device = attached.stdout.strip()
    try:
        done = _run("mount", "-o", "errors=remount-ro", device, str(mounted))
        if done.returncode != 0:
            unavailable(f"cannot mount ext4 from {device}: {done.stderr.strip()}")
        trigger = Path("/sys/fs/ext4") / Path(device).name / "trigger_fs_error"
        if not trigger.exists():
            unavailable(f"this kernel has no {trigger} to make the filesystem fail")
        yield mounted, device
    finally:
        _run("umount", "-l", str(mounted))
        _run("losetup", "-d", device)


def test_a_filesystem_turned_read_only_mid_stream_refuses_logs_little_and_loses_no_acknowledged_span(
    ext4_disk, tmp_path
):
    mounted, device = ext4_disk
    agent = Agent(mounted, tmp_path)
    agent.start()
    stop = threading.Event()
    senders = [Sender(n, agent.url, stop) for n in range(3)]
    for sender in senders:
        sender.start()
    try:
        wait_for("the first acknowledgements", lambda: all(len(s.acknowledged) > 200 for s in senders), timeout=30)
        (Path("/sys/fs/ext4") / Path(device).name / "trigger_fs_error").write_text("stagetrace test\n")
        failed_at = time.time()
        with pytest.raises(OSError) as refused_write:  # /proc/mounts says ro, or emergency_ro on newer kernels
            (mounted / "probe").write_bytes(b"x")
        assert refused_write.value.errno == errno.EROFS
        refused_before = sum(len(s.refusals) for s in senders)
        time.sleep(1.0)  # a request already written when the disk failed may still be answered
        acknowledged = sum(len(s.acknowledged) for s in senders)
        time.sleep(READ_ONLY_FOR_S - 1.0)
        # up, answering: every request refused, none acknowledged once the disk turned read-only
        assert agent.process.poll() is None, agent.log.read_text()
        refused = sum(len(s.refusals) for s in senders) - refused_before
        late = sum(len(s.acknowledged) for s in senders) - acknowledged
        assert refused >= 30 and late == 0, (refused, late, time.time() - failed_at)
        read_only_log = agent.log.read_text()
        agent.stop()  # as an operator would, to repair the filesystem
        assert _run("umount", str(mounted)).returncode == 0
        assert _run("e2fsck", "-fy", device).returncode in (0, 1)  # 1: errors corrected
        assert _run("mount", "-o", "errors=remount-ro", device, str(mounted)).returncode == 0
        again = sum(len(s.acknowledged) for s in senders) + 600
        agent.start()
        wait_for("acknowledgements again", lambda: sum(len(s.acknowledged) for s in senders) > again, timeout=60)
    finally:
        stop.set()
        for sender in senders:
            sender.join(timeout=60)
    agent.stop()
    agent.start()
    wait_for("the spool to drain", lambda: not spooled(agent.store), timeout=60)
    agent.stop()
    log = "\n".join(agent.lines())
    assert "Traceback" not in log, log
    assert not [e for s in senders for e in s.errors], [e for s in senders for e in s.errors]

    # the read-only spell in a few lines: what could not be written, once each, never a line per request
    spell = [line for line in read_only_log.splitlines() if not any(said in line for said in STARTS_AND_STOPS)]
    # EROFS, or EIO for a write that met the journal's abort
    assert read_only_log.count("cannot write requests (") == 1, read_only_log
    assert len(spell) <= 8 and refused > 4 * len(spell), (refused, read_only_log)

    assert_stored_once(agent.store, senders, 1200, log)
