"""The SandboxDriver contract: what every isolation driver must do, run against each implementation."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import sys

import pytest

from rlfleet.sandbox import (
    InvalidSandboxRequest,
    Limits,
    SandboxCapacityExhausted,
    SandboxDriver,
    SandboxDriverUnavailable,
    SandboxNotFound,
    SandboxSpec,
)

REAL_PREFIX = os.path.realpath(sys.base_prefix)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("bwrap"), reason="needs root and bubblewrap"),
]


@pytest.fixture(params=["bubblewrap"])
async def sandboxes(request, driver_factory):
    """Each driver implementation, started; add new drivers to `params`."""
    async with driver_factory() as d:
        assert isinstance(d, SandboxDriver)
        yield d


async def test_a_new_sandbox_runs_the_real_python_interpreter(sandboxes):
    h = await sandboxes.create()
    result = await sandboxes.exec(h, ["python3", "-c", "import sys; print(sys.prefix, sys.version_info[:3])"])
    assert result.ok, result
    assert result.stdout_text.strip() == f"{REAL_PREFIX} {tuple(sys.version_info[:3])}"


async def test_initial_files_are_in_the_workspace_and_runnable_from_a_subdirectory(sandboxes):
    spec = SandboxSpec(
        files={"pkg/main.py": "import data; print(data.X)", "pkg/data.py": "X = 41 + 1", "blob": b"\x00\xff"}
    )
    h = await sandboxes.create(spec)
    result = await sandboxes.exec(h, ["python3", "main.py"], cwd="pkg")
    assert result.stdout == b"42\n"
    assert (await sandboxes.read_files(h, ["blob"]))["blob"] == b"\x00\xff"
    listing = {f.path: f.kind for f in await sandboxes.list_files(h)}
    assert listing == {"blob": "file", "pkg": "dir", "pkg/data.py": "file", "pkg/main.py": "file"}
    assert [f.path for f in await sandboxes.list_files(h, "pkg", recursive=False)] == [
        "pkg/data.py",
        "pkg/main.py",
    ]


async def test_files_persist_across_execs_and_can_be_written_and_read_from_the_host(sandboxes):
    h = await sandboxes.create()
    await sandboxes.write_files(h, {"in.txt": "hello", "deep/er/x.txt": b"x"})
    result = await sandboxes.exec(
        h, ["sh", "-c", "tr a-z A-Z < in.txt > out.txt && echo made > deep/er/y.txt"]
    )
    assert result.ok, result
    again = await sandboxes.exec(h, ["cat", "out.txt", "deep/er/y.txt"])
    assert again.stdout == b"HELLOmade\n"
    assert await sandboxes.read_files(h, ["out.txt", "deep/er/x.txt"]) == {
        "out.txt": b"HELLO",
        "deep/er/x.txt": b"x",
    }
    # Files the host writes belong to the sandbox's user, so the program can change them.
    assert (await sandboxes.exec(h, ["sh", "-c", "echo more >> in.txt && rm deep/er/x.txt"])).ok


async def test_stdin_env_and_cwd_reach_the_program(sandboxes):
    h = await sandboxes.create(
        SandboxSpec(env={"FROM_SPEC": "s", "OVERRIDDEN": "spec"}, files={"sub/.keep": ""})
    )
    result = await sandboxes.exec(
        h,
        ["sh", "-c", 'read line; echo "$line|$FROM_SPEC|$OVERRIDDEN|$PWD|$HOME"'],
        stdin=b"from stdin\n",
        env={"OVERRIDDEN": "exec"},
        cwd="sub",
    )
    assert result.stdout == b"from stdin|s|exec|/work/sub|/work\n"


async def test_the_host_environment_does_not_leak_into_the_sandbox(sandboxes, monkeypatch):
    monkeypatch.setenv("RLFLEET_HOST_SECRET", "leak")
    h = await sandboxes.create()
    result = await sandboxes.exec(h, ["env"])
    assert b"RLFLEET_HOST_SECRET" not in result.stdout and b"leak" not in result.stdout


async def test_a_missing_program_exits_127_with_a_message(sandboxes):
    h = await sandboxes.create()
    result = await sandboxes.exec(h, ["no-such-program", "--flag"])
    assert result.exit_code == 127
    assert b"no-such-program" in result.stderr and b"No such file" in result.stderr
    assert not result.violations


async def test_exit_status_and_signals_are_reported(sandboxes):
    h = await sandboxes.create()
    assert (await sandboxes.exec(h, ["sh", "-c", "exit 3"])).exit_code == 3
    killed = await sandboxes.exec(h, ["sh", "-c", "kill -SEGV $$"])
    assert (killed.exit_code, killed.signal) == (128 + 11, 11)
    usage = await sandboxes.exec(h, ["python3", "-c", "sum(range(3 * 10**6))"])
    assert usage.cpu_s > 0.01 and usage.duration_s > 0


@pytest.mark.parametrize("argv", [[], "echo hi", ["echo", "a\0b"], [""], ["echo", 3]])
async def test_malformed_argv_is_an_invalid_request(sandboxes, argv):
    h = await sandboxes.create()
    with pytest.raises(InvalidSandboxRequest) as e:
        await sandboxes.exec(h, argv)
    assert e.value.field == "argv"


@pytest.mark.parametrize(
    ("limits", "field"),
    [
        ({"cpu_seconds": 0}, "limits.cpu_seconds"),
        ({"memory_bytes": 1 << 50}, "limits.memory_bytes"),
        ({"wall_seconds": -1}, "limits.wall_seconds"),
        ({"max_processes": 0}, "limits.max_processes"),
        ({"max_output_bytes": 1 << 40}, "limits.max_output_bytes"),
        ({"max_file_bytes": 0}, "limits.max_file_bytes"),
    ],
)
async def test_out_of_range_limits_are_invalid_requests_naming_the_field(limits, field):
    with pytest.raises(InvalidSandboxRequest) as e:
        SandboxSpec(limits=Limits(**limits))
    assert e.value.field == field
    assert "out of range" in str(e.value)


async def test_an_out_of_range_exec_timeout_is_an_invalid_request(sandboxes):
    h = await sandboxes.create()
    for timeout in (0, -1, 10**6, True):
        with pytest.raises(InvalidSandboxRequest) as e:
            await sandboxes.exec(h, ["true"], timeout=timeout)
        assert e.value.field == "timeout"


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "a/../../b", "", ".", "a\0b", "x/" + "y" * 300])
async def test_paths_outside_the_workspace_are_invalid_requests(sandboxes, path):
    h = await sandboxes.create()
    with pytest.raises(InvalidSandboxRequest):
        await sandboxes.write_files(h, {path: b"x"})
    with pytest.raises(InvalidSandboxRequest):
        await sandboxes.read_files(h, [path])


async def test_bad_cwd_and_list_paths_are_invalid_requests(sandboxes):
    h = await sandboxes.create()
    for cwd in ("..", "/tmp", "missing"):
        with pytest.raises(InvalidSandboxRequest) as e:
            await sandboxes.exec(h, ["true"], cwd=cwd)
        assert e.value.field == "cwd"
    with pytest.raises(InvalidSandboxRequest):
        await sandboxes.list_files(h, "../")


async def test_reading_a_missing_file_names_it(sandboxes):
    h = await sandboxes.create()
    with pytest.raises(InvalidSandboxRequest) as e:
        await sandboxes.read_files(h, ["nope.txt"])
    assert e.value.details["reason"] == "not_found" and "nope.txt" in str(e.value)


async def test_files_larger_than_max_file_bytes_are_refused(sandboxes):
    with pytest.raises(InvalidSandboxRequest):
        await sandboxes.create(SandboxSpec(limits=Limits(max_file_bytes=10), files={"a": b"x" * 11}))
    h = await sandboxes.create(SandboxSpec(limits=Limits(max_file_bytes=10)))
    with pytest.raises(InvalidSandboxRequest):
        await sandboxes.write_files(h, {"a": b"x" * 11})


async def test_a_destroyed_sandbox_is_not_found_with_the_reason(sandboxes):
    h = await sandboxes.create()
    await sandboxes.destroy(h)
    for call in (
        sandboxes.exec(h, ["true"]),
        sandboxes.read_files(h, ["a"]),
        sandboxes.write_files(h, {"a": b""}),
        sandboxes.list_files(h),
        sandboxes.destroy(h.id),
        sandboxes.get(h.id),
    ):
        with pytest.raises(SandboxNotFound) as e:
            await call
        assert e.value.sandbox_id == h.id and e.value.reason == "destroyed"
    with pytest.raises(SandboxNotFound) as e:
        await sandboxes.get("never-created")
    assert e.value.reason == "unknown"


async def test_destroying_a_sandbox_stops_its_running_exec(sandboxes):
    h = await sandboxes.create()
    running = asyncio.create_task(sandboxes.exec(h, ["sleep", "30"], timeout=60))
    await asyncio.sleep(0.5)
    await sandboxes.destroy(h)
    async with asyncio.timeout(5):
        with pytest.raises(SandboxNotFound):
            await running


async def test_execs_in_different_sandboxes_run_concurrently(sandboxes):
    handles = [await sandboxes.create() for _ in range(4)]
    started = asyncio.get_running_loop().time()
    results = await asyncio.gather(*(sandboxes.exec(h, ["sleep", "1"]) for h in handles))
    assert all(r.ok for r in results)
    assert asyncio.get_running_loop().time() - started < 3.5


async def test_list_sandboxes_shows_live_ones_with_their_labels(sandboxes):
    a = await sandboxes.create(SandboxSpec(labels={"task": "t1"}))
    b = await sandboxes.create()
    await sandboxes.destroy(b)
    live = await sandboxes.list_sandboxes()
    assert [(h.id, dict(h.labels)) for h in live] == [(a.id, {"task": "t1"})]


# -- bubblewrap-specific lifecycle ---------------------------------------------------------------


async def test_destroy_removes_everything_and_a_reused_uid_sees_nothing_of_the_earlier_episode(
    driver_factory,
):
    async with driver_factory(max_sandboxes=1) as d:
        first = await d.create(SandboxSpec(files={"secret.txt": "s3cret"}))
        await d.exec(
            first,
            ["sh", "-c", "echo s3cret > /work/more.txt; mkdir -p x/y; echo t > /tmp/t; echo m > /dev/shm/m"],
        )
        first_info = d.host_info(first)
        await d.destroy(first)
        assert not first_info["dir"].exists()
        second = await d.create()
        assert d.host_info(second)["uid"] == first_info["uid"]  # the only uid there is: reused
        assert await d.list_files(second) == []
        seen = await d.exec(
            second, ["sh", "-c", "ls -A /work /tmp /dev/shm; grep -rs s3cret /work /tmp /dev/shm; true"]
        )
        assert b"s3cret" not in seen.stdout
        assert seen.stdout.split() == [b"/dev/shm:", b"/tmp:", b"/work:"]


async def test_the_warm_pool_serves_creates_and_refills_in_the_background(driver_factory):
    async with driver_factory(pool_size=2) as d:
        await d.pool.wait_full()
        pooled = {p.name for p in d.config.root.iterdir() if p.is_dir()}
        assert len(pooled) == 2
        h = await d.create(SandboxSpec(files={"a": "1"}))
        assert h.id in pooled and h.from_warm_pool  # served from the pool, not made on the request path
        await d.pool.wait_full()
        assert len(d.pool) == 2
        assert (await d.exec(h, ["cat", "a"])).stdout == b"1"
        pooled_dirs = [p for p in d.config.root.iterdir() if p.is_dir()]
        assert len(pooled_dirs) == 3
    async with driver_factory(pool_size=0) as d:
        assert not (await d.create()).from_warm_pool
    # pool cleaned up too
    assert sorted(p.name for p in d.config.root.iterdir()) == [".driver.lock", ".uid_range"]


async def test_expired_sandboxes_are_reaped(driver_factory):
    async with driver_factory(reap_interval_s=0.1) as d:
        h = await d.create(SandboxSpec(ttl_seconds=0.3))
        workspace_dir = d.host_info(h)["dir"]
        await asyncio.sleep(0.8)
        with pytest.raises(SandboxNotFound) as e:
            await d.exec(h, ["true"])
        assert e.value.reason == "expired"
        assert not workspace_dir.exists()


async def test_creating_beyond_capacity_is_resource_exhausted_until_one_is_destroyed(driver_factory):
    async with driver_factory(max_sandboxes=2) as d:
        a = await d.create()
        await d.create()
        with pytest.raises(SandboxCapacityExhausted):
            await d.create()
        await d.destroy(a)
        await d.create()


async def test_a_second_driver_on_the_same_root_is_refused(driver_factory):
    async with driver_factory():
        with pytest.raises(SandboxDriverUnavailable) as e:
            async with driver_factory():
                pass
        assert e.value.reason == "root_in_use"


async def test_a_closed_driver_refuses_work_and_leaves_nothing_behind(driver_factory):
    d = driver_factory()
    await d.start()
    h = await d.create()
    await d.close()
    assert sorted(p.name for p in d.config.root.iterdir()) == [".driver.lock", ".uid_range"]
    assert d.uid_range is None  # the uid lease is given back
    with pytest.raises(SandboxDriverUnavailable):
        await d.create()
    with pytest.raises(SandboxNotFound):
        await d.exec(h, ["true"])


async def test_a_sandbox_with_network_can_reach_the_host_loopback(driver):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        h = await driver.create(SandboxSpec(network=True))
        code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5).sendall(b'hi')"
        result = await driver.exec(h, ["python3", "-c", code], timeout=10)
        assert result.ok, result
        server.settimeout(5)
        conn, _ = server.accept()
        with conn:
            assert conn.recv(2) == b"hi"


async def _run_as(uid: int) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec("setpriv", f"--reuid={uid}", "--regid=65534",
                                                "--clear-groups", "sleep", "60")
    for _ in range(1000):  # setpriv switches uid after the fork
        if os.stat(f"/proc/{proc.pid}").st_uid == uid:
            return proc
        await asyncio.sleep(0.01)
    raise AssertionError("setpriv did not switch uid")


async def test_a_driver_signals_only_its_leased_uid_range_and_two_drivers_lease_disjoint_ones(
        driver_factory, tmp_path):
    leases = tmp_path / "uid-leases"
    first = driver_factory(uid_lease_dir=leases)
    base = first.config.uid_base
    inside, outside = await _run_as(base + 3), await _run_as(base + 64)  # the range is base..base+63
    try:
        async with first:
            assert first.uid_range == (base, 64)
            assert await asyncio.wait_for(inside.wait(), 5) == -9  # a stray of its own range: cleared
            assert outside.returncode is None
            other = driver_factory(root=tmp_path / "other", uid_base=None, uid_lease_dir=leases,
                                   uid_search_from=base, uid_search_to=base + 256)
            async with other:  # unpinned, searching from this range: takes the next free one
                lo, count = other.uid_range
                assert lo >= base + 64 and lo != base + 64  # uid base+64 has a process: skipped
                h = await other.create()
                assert int((await other.exec(h, ["id", "-u"])).stdout) in range(lo, lo + count)
            assert outside.returncode is None
    finally:
        for proc in (inside, outside):
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
