"""The sandbox manager as a real process over gRPC: round trips, containment, bad input, TTL, crash recovery.

Each containment attempt of the driver's own tests is repeated once through the service, showing that
the violation reaches the caller (ExecResult) and the sandbox's record (GetSandbox), and that the
manager keeps serving afterwards.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import textwrap
import time
import urllib.request
import uuid
import zlib
from pathlib import Path

import grpc
import pytest

from rlfleet.api.sandbox.v1 import sandbox_pb2 as pb
from rlfleet.api.sandbox.v1 import sandbox_pb2_grpc
from rlfleet.common.config import RedisConfig
from rlfleet.common.grpc_server import channel as open_channel
from rlfleet.common.processes import ProcessNotReady, eventually
from rlfleet.common.redis_store import connect_redis, key
from rlfleet.common.rich_errors import error_details
from rlfleet.common.testing import unique_run_id
from rlfleet.sandbox.testing import sandbox_manager_config, start_sandbox_manager
from rlfleet.sandbox.uid_lease import live_leases

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("bwrap"), reason="needs root and bubblewrap"),
]

KiB, MiB = 1024, 1024 * 1024
V = pb.ViolationKind


@pytest.fixture(scope="module")
def manager(redis_url, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sandbox-manager")
    run_id = unique_run_id("sbx")
    process = start_sandbox_manager(redis_url, run_id, workdir, **{"driver.reap_interval_s": 0.3})
    process.run_id = run_id
    process.redis_url = redis_url
    process.root = workdir / "sandboxes"
    yield process
    assert process.stop() == 0, process.log()[-2000:]


@pytest.fixture
async def stub(manager):
    async with open_channel(manager.address) as channel:
        yield sandbox_pb2_grpc.SandboxServiceStub(channel)


def exists(path: str | Path) -> bool:
    return Path(path).exists()


def py(code: str) -> list[str]:
    return ["python3", "-c", textwrap.dedent(code)]


def kinds(violations) -> set[str]:
    return {V.Name(v.kind) for v in violations}


async def assert_manager_still_serves(stub, *sandbox_ids: str) -> None:
    fresh = await stub.CreateSandbox(pb.CreateSandboxRequest())
    for sandbox_id in (fresh.sandbox_id, *sandbox_ids):
        result = await stub.Exec(pb.ExecRequest(sandbox_id=sandbox_id, argv=py("print(6 * 7)")))
        assert (result.exit_code, result.stdout, list(result.violations)) == (0, b"42\n", []), result
    await stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=fresh.sandbox_id))


async def assert_recorded(stub, sandbox_id: str, result: pb.ExecResult, kind: str) -> None:
    """The violation is in the exec's result and in the sandbox's record."""
    assert kind in kinds(result.violations), result
    record = await stub.GetSandbox(pb.GetSandboxRequest(sandbox_id=sandbox_id))
    assert kind in kinds(record.violations)
    assert all(v.at_unix_ms > 0 and v.message for v in record.violations)


# -- round trip --------------------------------------------------------------------------------


async def test_create_write_exec_read_destroy_round_trip(stub, manager):
    created = await stub.CreateSandbox(pb.CreateSandboxRequest(
        files=[pb.File(path="data/in.txt", content=b"21\n")], limits=pb.Limits(wall_seconds=20),
        labels={"task": "t1"}, session_id="s-1"))
    assert created.sandbox_id and not created.network and not created.from_warm_pool
    assert created.limits.wall_seconds == 20 and created.limits.cpu_seconds == 10  # 0 = the manager's default
    assert created.expires_unix_ms - created.created_unix_ms == 3600 * 1000
    assert created.labels == {"task": "t1"}

    script = "#!/bin/sh\nexpr $(cat data/in.txt) \\* 2 > out/answer.txt\necho done\n"
    await stub.WriteFiles(pb.WriteFilesRequest(sandbox_id=created.sandbox_id,
                                               files=[pb.File(path="run.sh", content=script.encode(),
                                                              mode=0o755)]))
    result = await stub.Exec(pb.ExecRequest(sandbox_id=created.sandbox_id,
                                            argv=["sh", "-c", "mkdir out && ./run.sh"]))
    assert (result.exit_code, result.signal, result.stdout, result.stderr) == (0, 0, b"done\n", b""), result
    assert result.duration_s > 0 and not result.violations

    piped = await stub.Exec(pb.ExecRequest(sandbox_id=created.sandbox_id, argv=["cat"], stdin=b"via stdin",
                                           cwd="data", env={"X": "1"}))
    assert piped.stdout == b"via stdin"

    read = await stub.ReadFiles(pb.ReadFilesRequest(sandbox_id=created.sandbox_id,
                                                    paths=["out/answer.txt", "nope.txt", "data/in.txt"]))
    assert {f.path: f.content for f in read.files} == {"out/answer.txt": b"42\n", "data/in.txt": b"21\n"}
    assert list(read.missing) == ["nope.txt"]
    listed = await stub.ListFiles(pb.ListFilesRequest(sandbox_id=created.sandbox_id))
    assert sorted(listed.paths) == ["data/in.txt", "out/answer.txt", "run.sh"]
    mode = await stub.Exec(pb.ExecRequest(sandbox_id=created.sandbox_id, argv=["stat", "-c", "%a", "run.sh"]))
    assert mode.stdout == b"755\n"

    got = await stub.GetSandbox(pb.GetSandboxRequest(sandbox_id=created.sandbox_id))
    assert got.exec_count == 3 and not got.violations

    redis = await connect_redis(RedisConfig(url=manager.redis_url))
    lease_key = key(manager.run_id, "sandbox", "leases", created.sandbox_id)
    lease = await redis.hgetall(lease_key)
    assert lease[b"session_id"] == b"s-1" and lease[b"owner"] and 0 < await redis.pttl(lease_key)

    await stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=created.sandbox_id))
    assert not await redis.exists(lease_key)
    await redis.aclose()
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await stub.GetSandbox(pb.GetSandboxRequest(sandbox_id=created.sandbox_id))
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND and "destroyed" in gone.value.details()
    assert not exists(manager.root / created.sandbox_id)


# -- containment, through the service ------------------------------------------------------------


async def test_network_to_a_host_loopback_port_fails_and_is_recorded(stub):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.setblocking(False)
        port = server.getsockname()[1]
        box = await stub.CreateSandbox(pb.CreateSandboxRequest())
        result = await stub.Exec(pb.ExecRequest(sandbox_id=box.sandbox_id, argv=py(f"""
            import socket, sys
            for host in ("127.0.0.1", "10.255.255.1"):
                try:
                    socket.create_connection((host, {port}), timeout=2); print("connected", host)
                except OSError as e:
                    print(host, e, file=sys.stderr)
        """)))
        assert b"connected" not in result.stdout and b"Network is unreachable" in result.stderr
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing reached the host
    await assert_recorded(stub, box.sandbox_id, result, "VIOLATION_KIND_NETWORK")
    await assert_manager_still_serves(stub, box.sandbox_id)


async def test_reading_another_sandboxs_workspace_finds_nothing(stub, manager):
    secret = uuid.uuid4().hex
    victim = await stub.CreateSandbox(pb.CreateSandboxRequest(
        files=[pb.File(path="secret.txt", content=secret.encode())]))
    attacker = await stub.CreateSandbox(pb.CreateSandboxRequest())
    probes = [str(manager.root / victim.sandbox_id / "work" / "secret.txt"),
              f"/work/../{victim.sandbox_id}/work/secret.txt", str(manager.root)]
    result = await stub.Exec(pb.ExecRequest(sandbox_id=attacker.sandbox_id, argv=py(f"""
        import os
        for p in {probes!r}:
            print(p, open(p).read() if os.path.isfile(p) else "exists" if os.path.exists(p) else "absent")
    """)))
    assert secret.encode() not in result.stdout and result.stdout.count(b"absent") == len(probes), result
    # Nothing to record: the other workspace does not exist in the attacker's view.
    record = await stub.GetSandbox(pb.GetSandboxRequest(sandbox_id=attacker.sandbox_id))
    assert list(record.violations) == list(result.violations) == []
    read = await stub.ReadFiles(pb.ReadFilesRequest(sandbox_id=attacker.sandbox_id, paths=["secret.txt"]))
    assert list(read.missing) == ["secret.txt"]
    await assert_manager_still_serves(stub, victim.sandbox_id, attacker.sandbox_id)


ATTACKS = {
    "write outside the workspace": (
        pb.Limits(), """
        import sys
        for t in ["/etc/rlfleet-escape", "/usr/rlfleet-escape", "/rlfleet-escape"]:
            try:
                open(t, "w").write("x"); print("WROTE", t)
            except OSError as e:
                print(t, e, file=sys.stderr)
        """, "VIOLATION_KIND_FILESYSTEM"),
    "fork bomb": (
        pb.Limits(max_processes=16, wall_seconds=3, cpu_seconds=5), """
        import os, sys, time
        for _ in range(64):
            try:
                if os.fork() == 0:
                    continue
            except OSError as e:
                print(type(e).__name__, e, file=sys.stderr, flush=True); break
        time.sleep(60)
        """, "VIOLATION_KIND_PROCESSES"),
    "memory hog": (
        pb.Limits(memory_bytes=64 * MiB, wall_seconds=15), """
        chunks = [b"x" * (16 << 20) for _ in range(64)]
        print("allocated")
        """, "VIOLATION_KIND_MEMORY"),
    "endless loop": (pb.Limits(cpu_seconds=1, wall_seconds=10), "while True: pass", "VIOLATION_KIND_CPU"),
    "output flood": (
        pb.Limits(max_output_bytes=64 * KiB, wall_seconds=15),
        "import sys; sys.stdout.buffer.write(b'x' * (32 << 20))", "VIOLATION_KIND_OUTPUT"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
async def test_a_containment_attempt_is_stopped_recorded_and_the_manager_keeps_serving(stub, attack):
    limits, code, expected = ATTACKS[attack]
    box = await stub.CreateSandbox(pb.CreateSandboxRequest(limits=limits))
    started = time.monotonic()
    result = await stub.Exec(pb.ExecRequest(sandbox_id=box.sandbox_id, argv=py(code)))
    assert time.monotonic() - started < 15
    assert b"WROTE" not in result.stdout and b"allocated" not in result.stdout
    await assert_recorded(stub, box.sandbox_id, result, expected)
    if attack == "endless loop":
        assert (result.signal, result.exit_code) == (24, -24)  # SIGXCPU, as the proto's -N
    if attack == "fork bomb":
        assert "VIOLATION_KIND_TIMEOUT" in kinds(result.violations)
    if attack == "output flood":
        assert len(result.stdout) == 64 * KiB and result.stdout_truncated
    assert not any(exists(t) for t in ("/etc/rlfleet-escape", "/usr/rlfleet-escape", "/rlfleet-escape"))
    await assert_manager_still_serves(stub, box.sandbox_id)


# -- bad input ---------------------------------------------------------------------------------


async def expect(code: grpc.StatusCode, call, *words: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == code, err.value
    for word in words:
        assert word in err.value.details(), err.value.details()


async def test_bad_requests_are_rejected_with_the_field_named(stub):
    missing = "0123456789abcdef"
    for call in (stub.GetSandbox(pb.GetSandboxRequest(sandbox_id=missing)),
                 stub.Exec(pb.ExecRequest(sandbox_id=missing, argv=["true"])),
                 stub.ReadFiles(pb.ReadFilesRequest(sandbox_id=missing, paths=["a"])),
                 stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=missing))):
        await expect(grpc.StatusCode.NOT_FOUND, call, missing)

    bad = grpc.StatusCode.INVALID_ARGUMENT
    await expect(bad, stub.CreateSandbox(pb.CreateSandboxRequest(limits=pb.Limits(memory_bytes=1 << 40))),
                 "limits.memory_bytes")
    await expect(bad, stub.CreateSandbox(pb.CreateSandboxRequest(limits=pb.Limits(cpu_seconds=0.5))),
                 "limits.cpu_seconds")
    await expect(bad, stub.CreateSandbox(pb.CreateSandboxRequest(limits=pb.Limits(wall_seconds=-1))),
                 "limits.wall_seconds")
    await expect(bad, stub.CreateSandbox(pb.CreateSandboxRequest(ttl_seconds=10**9)), "ttl_seconds")
    await expect(bad, stub.CreateSandbox(pb.CreateSandboxRequest(network=True)), "network")
    await expect(bad, stub.CreateSandbox(pb.CreateSandboxRequest(files=[pb.File(path="../x", content=b"")])),
                 "..")

    box = await stub.CreateSandbox(pb.CreateSandboxRequest())
    await expect(bad, stub.Exec(pb.ExecRequest(sandbox_id=box.sandbox_id)), "argv")
    await expect(bad,
                 stub.Exec(pb.ExecRequest(sandbox_id=box.sandbox_id, argv=["true"], timeout_seconds=10**6)),
                 "timeout_seconds")
    await expect(bad, stub.Exec(pb.ExecRequest(sandbox_id=box.sandbox_id, argv=["true"], cwd="../..")), "cwd")
    for path in ("/etc/passwd", "../../etc/passwd", ""):
        await expect(bad, stub.ReadFiles(pb.ReadFilesRequest(sandbox_id=box.sandbox_id, paths=[path])),
                     "path")
        await expect(bad, stub.WriteFiles(pb.WriteFilesRequest(sandbox_id=box.sandbox_id,
                                                               files=[pb.File(path=path, content=b"x")])),
                     "path")
    await expect(bad, stub.WriteFiles(pb.WriteFilesRequest(sandbox_id=box.sandbox_id,
                                                           files=[pb.File(path="s", content=b"",
                                                                          mode=0o4755)])), "mode")
    await stub.WriteFiles(pb.WriteFilesRequest(sandbox_id=box.sandbox_id,
                                               files=[pb.File(path="big", content=b"x" * 100)]))
    await expect(bad, stub.ReadFiles(pb.ReadFilesRequest(sandbox_id=box.sandbox_id, paths=["big"],
                                                         max_bytes_per_file=10)),
                 "max_bytes_per_file")
    await assert_manager_still_serves(stub, box.sandbox_id)


# -- lifetime ----------------------------------------------------------------------------------


async def test_an_expired_sandbox_is_reaped_and_its_lease_dropped(stub, manager):
    box = await stub.CreateSandbox(pb.CreateSandboxRequest(ttl_seconds=0.5))
    redis = await connect_redis(RedisConfig(url=manager.redis_url))
    lease_key = key(manager.run_id, "sandbox", "leases", box.sandbox_id)
    assert await redis.exists(lease_key)
    async def reaped() -> bool:
        return not await redis.exists(lease_key) and not exists(manager.root / box.sandbox_id)

    assert await eventually(reaped, within_s=10)
    await redis.aclose()
    await expect(grpc.StatusCode.NOT_FOUND, stub.GetSandbox(pb.GetSandboxRequest(sandbox_id=box.sandbox_id)))


async def test_metrics_count_creates_execs_violations_and_active_sandboxes(stub, manager):
    box = await stub.CreateSandbox(pb.CreateSandboxRequest(limits=pb.Limits(cpu_seconds=1)))
    await stub.Exec(pb.ExecRequest(sandbox_id=box.sandbox_id, argv=py("while True: pass")))
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(manager.metrics_url, timeout=5).read().decode())
    lines = text.splitlines()
    assert any(line.startswith("rlfleet_sandbox_creates_total{") and 'from_warm_pool="false"' in line
               for line in lines)
    assert "rlfleet_sandbox_exec_latency_seconds_count" in text
    assert any(line.startswith("rlfleet_sandbox_violations_total{") and 'kind="cpu"' in line
               for line in lines)
    active = [line for line in text.splitlines() if line.startswith("rlfleet_sandbox_active_sandboxes")]
    assert active and float(active[0].split()[-1]) >= 1
    assert any(line.startswith("rlfleet_sandbox_warm_pool_size") for line in text.splitlines())
    await stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=box.sandbox_id))


# -- crash recovery ----------------------------------------------------------------------------


def uid_processes(first_uid: int, count: int) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if first_uid <= entry.stat().st_uid < first_uid + count:
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


async def test_a_manager_killed_with_sigkill_is_cleaned_up_by_its_successor(redis_url, tmp_path):
    run_id = unique_run_id("sbxcrash")
    uid_base = sandbox_manager_config(redis_url, run_id, tmp_path)["driver.uid_base"]
    root = tmp_path / "sandboxes"
    first = start_sandbox_manager(redis_url, run_id, tmp_path)
    stray = None
    try:
        async with open_channel(first.address) as channel:
            stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
            boxes = [await stub.CreateSandbox(pb.CreateSandboxRequest(files=[pb.File(path="f",
                                                                                     content=b"x")]))
                     for _ in range(2)]
            busy = asyncio.ensure_future(stub.Exec(pb.ExecRequest(sandbox_id=boxes[0].sandbox_id,
                                                                  argv=["sleep", "300"])))
            await asyncio.sleep(0.5)
            # A process under the manager's uid range that outlived it (what a driver crash can leave).
            stray = await asyncio.create_subprocess_exec("setpriv", f"--reuid={uid_base + 5}",
                                                         "--regid=65534", "--clear-groups", "sleep", "300")
            first.kill()
            busy.cancel()
        redis = await connect_redis(RedisConfig(url=redis_url))
        lease_keys = [key(run_id, "sandbox", "leases", b.sandbox_id) for b in boxes]
        assert all([await redis.exists(k) for k in lease_keys])
        assert all(exists(root / b.sandbox_id / "work" / "f") for b in boxes)
        assert stray.pid in uid_processes(uid_base, 64)

        second = start_sandbox_manager(redis_url, run_id, tmp_path)
        try:
            assert not any([await redis.exists(k) for k in lease_keys])
            assert not any(exists(root / b.sandbox_id) for b in boxes)
            assert await asyncio.wait_for(stray.wait(), 5) == -9

            async def no_processes_left() -> bool:  # killed processes take a moment to be reaped
                return not uid_processes(uid_base, 64)

            assert await eventually(no_processes_left, within_s=5)
            async with open_channel(second.address) as channel:
                stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
                await expect(grpc.StatusCode.NOT_FOUND,
                             stub.GetSandbox(pb.GetSandboxRequest(sandbox_id=boxes[0].sandbox_id)))
                await assert_manager_still_serves(stub)
            assert "predecessor_leases_removed" in second.log()
        finally:
            assert second.stop() == 0
        await redis.aclose()
    finally:
        first.stop()
        if stray is not None and stray.returncode is None:
            stray.kill()
            await stray.wait()


# -- sharing a host ----------------------------------------------------------------------------


async def test_two_platforms_on_one_host_lease_disjoint_uid_ranges_and_never_kill_each_others_execs(
        redis_url, tmp_path):
    """Two runs' managers on one host, neither pinning a uid range (the default): each leases its own
    range host-wide, and the second's start (which clears its range) and execs leave the first's
    running exec alone."""
    lease_dir = tmp_path / "uid-leases"
    window = 2_000_000 + (zlib.crc32(str(tmp_path).encode()) % 5000) * 256
    shared = {"driver.uid_base": None, "driver.uid_lease_dir": str(lease_dir),
              "driver.uid_search_from": window, "driver.uid_search_to": window + 256}
    first = start_sandbox_manager(redis_url, unique_run_id("sbxhostA"), tmp_path / "a", **shared)
    second = None
    try:
        async with open_channel(first.address) as channel_a:
            stub_a = sandbox_pb2_grpc.SandboxServiceStub(channel_a)
            box_a = await stub_a.CreateSandbox(pb.CreateSandboxRequest(limits=pb.Limits(wall_seconds=60)))
            running = asyncio.ensure_future(stub_a.Exec(pb.ExecRequest(
                sandbox_id=box_a.sandbox_id, argv=py("""
                import os, time
                time.sleep(6)
                print("a survived", os.getuid())
            """))))
            await asyncio.sleep(1.0)  # the exec is running when the second manager starts
            second = await asyncio.to_thread(start_sandbox_manager, redis_url, unique_run_id("sbxhostB"),
                                             tmp_path / "b", **shared)
            async with open_channel(second.address) as channel_b:
                stub_b = sandbox_pb2_grpc.SandboxServiceStub(channel_b)
                boxes_b = [await stub_b.CreateSandbox(pb.CreateSandboxRequest()) for _ in range(3)]
                results_b = await asyncio.gather(*(stub_b.Exec(pb.ExecRequest(
                    sandbox_id=b.sandbox_id, argv=py("import os, time; time.sleep(1); print(os.getuid())")))
                    for b in boxes_b))
                for b in boxes_b:
                    await stub_b.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=b.sandbox_id))
            result_a = await running
        assert (result_a.exit_code, list(result_a.violations)) == (0, []), result_a
        uid_a = int(result_a.stdout.split()[-1])
        assert all(r.exit_code == 0 and not r.violations for r in results_b), results_b
        uids_b = {int(r.stdout) for r in results_b}

        leases = {rec["pid"]: r for r, rec in live_leases(lease_dir)}
        range_a, range_b = leases[first.pid], leases[second.pid]
        assert not range_a.overlaps(range_b)
        assert uid_a in range_a and all(u in range_b for u in uids_b)

        # Pinning a range the first manager holds is refused at start, naming the holder.
        with pytest.raises(ProcessNotReady) as refused:
            start_sandbox_manager(redis_url, unique_run_id("sbxhostC"), tmp_path / "c",
                                  **{**shared, "driver.uid_base": range_a.first})
        assert "pick a free range" in str(refused.value)
        log = "".join(p.read_text() for p in (tmp_path / "c").glob("*.log"))
        assert f"leased by pid {first.pid}" in log, log[-2000:]
    finally:
        if second is not None:
            assert second.stop() == 0
        assert first.stop() == 0
    assert live_leases(lease_dir) == []  # a clean stop gives the range back


# -- caps on open sandboxes and TTL --------------------------------------------------------------


async def test_one_client_cannot_take_every_slot_and_the_run_has_a_cap_too(redis_url, tmp_path):
    manager = start_sandbox_manager(redis_url, unique_run_id("sbxcaps"), tmp_path,
                                    max_open_sandboxes=6, max_sandboxes_per_client=4, max_ttl_s=7200)
    try:
        async with open_channel(manager.address) as channel:
            stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
            greedy = (("rlfleet-client-id", "greedy"),)
            mine = [await stub.CreateSandbox(pb.CreateSandboxRequest(), metadata=greedy) for _ in range(4)]
            with pytest.raises(grpc.aio.AioRpcError) as capped:
                await stub.CreateSandbox(pb.CreateSandboxRequest(), metadata=greedy)
            details = error_details(capped.value)
            assert details.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (details.metadata["quota"] == "max_sandboxes_per_client"
                    and details.metadata["limit"] == "4")
            assert details.metadata["client_id"] == "greedy" and details.metadata["open"] == "4"
            assert "greedy" in details.message

            # Another client (here named by a label) still gets its own, up to the run's cap.
            others = [await stub.CreateSandbox(pb.CreateSandboxRequest(labels={"client_id": "polite"}))
                      for _ in range(2)]
            with pytest.raises(grpc.aio.AioRpcError) as full:
                await stub.CreateSandbox(pb.CreateSandboxRequest())
            details = error_details(full.value)
            assert details.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (details.metadata["quota"], details.metadata["limit"]) == ("max_open_sandboxes", "6")

            # Destroying frees a slot for the client that held it.
            await stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=mine[0].sandbox_id))
            again = await stub.CreateSandbox(pb.CreateSandboxRequest(), metadata=greedy)

            with pytest.raises(grpc.aio.AioRpcError) as too_long:
                await stub.CreateSandbox(pb.CreateSandboxRequest(ttl_seconds=3 * 3600))
            details = error_details(too_long.value)
            assert details.code == grpc.StatusCode.INVALID_ARGUMENT and details.field == "ttl_seconds"
            assert float(details.metadata["maximum"]) == 7200
            for box in [*mine[1:], *others, again]:
                await stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=box.sandbox_id))
            await assert_manager_still_serves(stub)
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(manager.metrics_url, timeout=5).read().decode())
        assert any(line.startswith("rlfleet_sandbox_creates_refused_total{")
                   and 'cap="sandboxes_per_client"' in line
                   for line in text.splitlines())
    finally:
        assert manager.stop() == 0


async def test_a_1_gib_and_a_20000_file_writer_hit_the_workspace_quotas_not_the_host_disk(stub, manager):
    """The defaults (256 MiB, 10,000 inodes per workspace): both writers fail cleanly with ENOSPC, the
    violation is recorded, the disk under the manager's root is untouched and the sandbox goes on."""
    box = await stub.CreateSandbox(pb.CreateSandboxRequest(limits=pb.Limits(wall_seconds=120)))
    disk = os.statvfs(manager.root)
    free_before = disk.f_bavail * disk.f_frsize
    big = await stub.Exec(pb.ExecRequest(sandbox_id=box.sandbox_id, argv=py("""
        chunk, written = b"x" * (1 << 20), 0
        try:
            for n in range(16):  # 16 files of 64 MiB (max_file_bytes): 1 GiB
                with open(f"part{n}", "wb") as f:
                    for _ in range(64):
                        f.write(chunk); f.flush(); written += 1
        except OSError as e:
            print("stopped at", written, "MiB, errno", e.errno)
    """)))
    assert big.stdout.startswith(b"stopped at") and b"errno 28" in big.stdout, big
    assert int(big.stdout.split()[2]) <= 256
    assert "VIOLATION_KIND_FILESYSTEM" in kinds(big.violations), big
    disk = os.statvfs(manager.root)
    assert disk.f_bavail * disk.f_frsize > free_before - 32 * MiB  # the 256 MiB went to the tmpfs
    many = await stub.Exec(pb.ExecRequest(sandbox_id=box.sandbox_id, argv=py("""
        import os, glob
        for p in glob.glob("part*"): os.remove(p)
        n = 0
        try:
            for i in range(20000):
                open(f"f{i}", "w").close(); n += 1
        except OSError as e:
            print("stopped at", n, "files, errno", e.errno)
    """)))
    assert many.stdout.startswith(b"stopped at") and b"errno 28" in many.stdout, many
    assert int(many.stdout.split()[2]) < 10_000
    await assert_recorded(stub, box.sandbox_id, many, "VIOLATION_KIND_FILESYSTEM")
    await stub.Exec(pb.ExecRequest(sandbox_id=box.sandbox_id, argv=["sh", "-c", "rm -f f*"]))
    await assert_manager_still_serves(stub, box.sandbox_id)
    await stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=box.sandbox_id))
