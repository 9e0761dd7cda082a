"""Host-wide uid-range leases: overlap refused, free ranges picked, stale leases (dead holder) reclaimed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import zlib

import pytest

from rlfleet.sandbox.errors import SandboxDriverUnavailable
from rlfleet.sandbox.uid_lease import UidRange, lease_uid_range, live_leases


@pytest.fixture
def window(tmp_path):
    """A search window of its own (hashed from the path): picking never meets other tests' uids."""
    start = 3_000_000 + (zlib.crc32(str(tmp_path).encode()) % 10_000) * 1024
    return {"search_from": start, "search_to": start + 1024}


def lease(directory, count, window, **kw):
    return lease_uid_range(directory, count, pinned=kw.pop("pinned", None), **window, **kw)


def test_two_leases_get_disjoint_ranges_and_a_released_range_is_reused(tmp_path, window):
    a = lease(tmp_path, 64, window)
    b = lease(tmp_path, 64, window)
    assert not a.uids.overlaps(b.uids)
    assert (a.uids.first, b.uids.first) == (window["search_from"], window["search_from"] + 64)
    assert {r for r, _ in live_leases(tmp_path)} == {a.uids, b.uids}
    record = json.loads(a.path.read_text())
    assert record["pid"] == os.getpid() and record["first"] == a.uids.first
    a.release()
    assert not a.path.exists() and not a.held
    c = lease(tmp_path, 32, window)
    assert c.uids == UidRange(window["search_from"], 32)
    b.release()
    c.release()
    assert live_leases(tmp_path) == []


def test_a_pinned_range_overlapping_a_live_lease_is_refused_naming_the_holder(tmp_path, window):
    first = window["search_from"]
    held = lease(tmp_path, 64, window, pinned=first)
    with pytest.raises(SandboxDriverUnavailable) as refused:
        lease(tmp_path, 64, window, pinned=first + 63)
    assert refused.value.reason == "uid_range_in_use"
    assert refused.value.details["holder_pid"] == os.getpid()
    assert str(first) in str(refused.value)
    next_door = lease(tmp_path, 64, window, pinned=first + 64)  # adjacent, not overlapping
    held.release()
    next_door.release()


def test_the_preferred_range_is_taken_when_free_else_the_lowest_free_one(tmp_path, window):
    start = window["search_from"]
    mine = lease(tmp_path, 64, window, preferred=start + 256)
    assert mine.uids.first == start + 256
    other = lease(tmp_path, 64, window, preferred=start + 256 + 32)  # overlaps mine: not taken
    assert other.uids.first == start
    mine.release()
    other.release()


def test_a_lease_whose_holder_was_killed_is_stale_and_reclaimed(tmp_path, window):
    first = window["search_from"]
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from rlfleet.sandbox.uid_lease import lease_uid_range
        lease = lease_uid_range(Path({str(tmp_path)!r}), 64, pinned={first}, search_from=0, search_to=0)
        print("held", flush=True)
        time.sleep(300)
    """)
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SandboxDriverUnavailable) as refused:
            lease(tmp_path, 64, window, pinned=first)
        assert refused.value.details["holder_pid"] == holder.pid
        holder.kill()  # no release: the lease file stays, but nobody holds its lock
        holder.wait()
        assert (tmp_path / f"{first}-64.lease").exists()
        reclaimed = lease(tmp_path, 64, window, pinned=first)
        assert json.loads(reclaimed.path.read_text())["pid"] == os.getpid()
        reclaimed.release()
    finally:
        holder.kill()
        holder.wait()


def test_picking_skips_uids_some_process_is_running_as(tmp_path, window):
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another uid")
    start = window["search_from"]
    stray = subprocess.Popen(["setpriv", f"--reuid={start + 10}", "--regid=65534", "--clear-groups",
                              "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while os.stat(f"/proc/{stray.pid}").st_uid != start + 10:  # setpriv switches after the fork
            assert time.monotonic() < deadline
            time.sleep(0.01)
        picked = lease(tmp_path, 64, window)
        assert picked.uids.first == start + 11 and start + 10 not in picked.uids
        picked.release()
    finally:
        stray.kill()
        stray.wait()


def test_no_free_range_is_a_clear_error(tmp_path, window):
    small = {"search_from": window["search_from"], "search_to": window["search_from"] + 100}
    held = lease(tmp_path, 64, small)
    with pytest.raises(SandboxDriverUnavailable) as refused:
        lease(tmp_path, 64, small)
    assert refused.value.reason == "no_free_uid_range"
    held.release()


def test_a_third_lease_is_picked_beside_two_held_ones(tmp_path, window):
    """Two live leases on the host: picking orders them (on a shared host this is the usual case)."""
    held = [lease(tmp_path, 64, window) for _ in range(2)]
    third = lease(tmp_path, 64, window)
    assert third.uids == UidRange(window["search_from"] + 128, 64)
    for one in (*held, third):
        one.release()
