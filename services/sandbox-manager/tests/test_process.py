"""run_captured on plain processes: capped capture, deadlines, rusage, nothing left behind."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from rlfleet.sandbox.process import run_captured

ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


async def run(argv, *, stdin=b"", timeout_s=10.0, cap=1 << 20, **kw):
    return await run_captured(
        lambda _fd: argv, env=ENV, stdin=stdin, timeout_s=timeout_s, max_output_bytes=cap, **kw
    )


async def test_stdout_stderr_stdin_and_exit_status_are_captured():
    out = await run(["sh", "-c", "cat; echo err >&2; exit 3"], stdin=b"in")
    assert (out.stdout.data, out.stderr.data, out.exit_code, out.timed_out) == (b"in", b"err\n", 3, False)


async def test_a_large_stdin_does_not_block_when_the_program_never_reads_it():
    out = await run(["true"], stdin=b"x" * (8 << 20), timeout_s=5)
    assert out.exit_code == 0 and not out.timed_out


async def test_output_past_the_cap_is_read_and_dropped_keeping_the_tail():
    code = "import sys; sys.stdout.buffer.write(b'a' * (8 << 20) + b'END')"
    out = await run([sys.executable, "-c", code], cap=1000)
    assert out.exit_code == 0  # the writer never blocked on a full pipe
    assert out.stdout.data == b"a" * 1000 and out.stdout.truncated
    assert out.stdout.total_bytes == (8 << 20) + 3 and out.stdout.tail.endswith(b"END")


async def test_the_deadline_kills_the_whole_process_group_including_grandchildren():
    out = await run(["sh", "-c", "sleep 60 & sleep 60"], timeout_s=0.5)
    assert out.timed_out and out.exit_code == 128 + 9
    assert out.duration_s < 3


async def test_cpu_time_comes_from_the_kernel():
    out = await run([sys.executable, "-c", "sum(range(5 * 10**6))"])
    assert out.cpu_s > 0.02


async def test_cancelling_kills_and_reaps_the_child():
    kills: list = []
    task = asyncio.create_task(run(["sleep", "60"], on_spawn=kills.append))
    await asyncio.sleep(0.2)
    pid = kills[0].__self__.pid  # the bound kill method's child
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not _alive(pid)  # killed and reaped: not even a zombie is left


async def test_a_kill_from_elsewhere_ends_the_run():
    kills: list = []
    task = asyncio.create_task(run(["sleep", "60"], on_spawn=kills.append))
    await asyncio.sleep(0.2)
    kills[0]()
    out = await asyncio.wait_for(task, 5)
    assert out.exit_code == 128 + 9 and not out.timed_out


async def test_a_status_fd_is_passed_and_read():
    out = await run_captured(
        lambda fd: [sys.executable, "-c", f"import os; os.write({fd}, b'status\\n'); print('out')"],
        env=ENV,
        stdin=b"",
        timeout_s=5,
        max_output_bytes=100,
        status_fd=True,
    )
    assert out.status_data == b"status\n" and out.stdout.data == b"out\n"
