"""Per-sandbox workspace quotas: a tmpfs of its own, limited in bytes and inodes.

A writer that goes past the quota fails cleanly (ENOSPC inside the sandbox, a FILESYSTEM violation
observed by the driver), host-side writes past it are RESOURCE_EXHAUSTED naming the quota, nothing
reaches the disk under the driver's root, and the next exec and sandbox work as before.
"""

from __future__ import annotations

import os
import shutil
import textwrap

import pytest

from rlfleet.sandbox import SandboxQuotaExceeded, SandboxSpec, ViolationKind
from rlfleet.sandbox.limits import GiB, Limits, MiB
from rlfleet.sandbox.workspace import mounts_under

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("bwrap"), reason="needs root and bubblewrap"),
]


def py(code: str) -> list[str]:
    return ["python3", "-c", textwrap.dedent(code)]


def disk_free(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


async def test_a_1_gib_writer_stops_at_the_byte_quota_and_the_host_disk_is_untouched(driver_factory):
    async with driver_factory(workspace_bytes=64 * MiB) as d:
        h = await d.create(SandboxSpec(limits=Limits(max_file_bytes=2 * GiB, memory_bytes=1 * GiB,
                                                     wall_seconds=60)))
        host_disk_before = disk_free(d.config.root)
        result = await d.exec(h, py("""
            import os
            chunk = b"x" * (1 << 20)
            written = 0
            try:
                with open("big.bin", "wb") as f:
                    for _ in range(1024):  # 1 GiB
                        f.write(chunk)
                        f.flush()
                        written += len(chunk)
            except OSError as e:
                print("stopped", written >> 20, e.errno)
        """))
        assert result.stdout_text.split()[0] == "stopped", result
        mib, err = (int(x) for x in result.stdout_text.split()[1:])
        assert mib <= 64 and err == 28  # ENOSPC at the 64 MiB quota, not at 1 GiB
        quota = [v for v in result.violations if v.kind == ViolationKind.FILESYSTEM]
        assert quota and not quota[0].inferred and f"{64 * MiB}-byte quota" in quota[0].message
        # Nothing went to the disk the driver's root lives on (the workspace is a tmpfs).
        assert disk_free(d.config.root) > host_disk_before - 16 * MiB
        work = d.host_info(h)["workspace"]
        assert os.statvfs(work).f_blocks * os.statvfs(work).f_frsize <= 64 * MiB + 4096
        assert work in mounts_under(d.config.root)
        still_full = await d.exec(h, ["true"])  # filled earlier: not held against a later exec
        assert (still_full.exit_code, still_full.violations) == (0, ())
        # Host-side writes past the quota are refused naming it; after deleting, work goes on.
        with pytest.raises(SandboxQuotaExceeded) as refused:
            await d.write_files(h, {"more.bin": b"y" * (1 * MiB)})
        assert refused.value.quota == "workspace_bytes" and refused.value.limit == 64 * MiB
        after = await d.exec(h, ["sh", "-c", "rm big.bin && echo ok > small && cat small"])
        assert (after.exit_code, after.stdout, after.violations) == (0, b"ok\n", ())
        await d.destroy(h)
        assert work not in mounts_under(d.config.root)
        assert not work.exists()


async def test_a_20000_file_writer_stops_at_the_inode_quota(driver_factory):
    async with driver_factory(workspace_inodes=1000) as d:
        h = await d.create()
        result = await d.exec(h, py("""
            import os
            os.mkdir("many")
            n = 0
            try:
                for i in range(20000):
                    open(f"many/{i}", "w").close()
                    n += 1
            except OSError as e:
                print("stopped", n, e.errno)
        """))
        words = result.stdout_text.split()
        assert words[0] == "stopped" and int(words[1]) < 1000 and words[2] == "28", result
        quota = [v for v in result.violations if v.kind == ViolationKind.FILESYSTEM]
        assert quota and not quota[0].inferred and "1000-inode" in quota[0].message
        other = await d.create()  # a neighbour's quota is its own
        ok = await d.exec(other, py("[open(f'f{i}', 'w').close() for i in range(500)]; print('ok')"))
        assert (ok.exit_code, ok.violations) == (0, ())


async def test_a_crashed_drivers_workspace_mounts_are_swept_by_its_successor(driver_factory):
    first = driver_factory()
    await first.start()
    h = await first.create(SandboxSpec(files={"f": "x"}))
    work = first.host_info(h)["workspace"]
    assert work in mounts_under(first.config.root)
    first._unlock_root()  # as if the process had died: its lock is gone, its mounts are not
    first._uid_lease.release()
    async with driver_factory() as second:
        assert work not in mounts_under(second.config.root) and not work.exists()
