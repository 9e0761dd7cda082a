"""Containment: each test is one escape or exhaustion attempt from inside a sandbox.

Every test asserts three things: the attempt is stopped, it is recorded as a violation where the
driver can know about it, and the host and the driver keep working (a normal exec succeeds after).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import shutil
import socket
import textwrap
import uuid
from pathlib import Path

import pytest

from rlfleet.sandbox import InvalidSandboxRequest, Limits, SandboxSpec, ViolationKind
from rlfleet.sandbox.bubblewrap import BubblewrapDriver
from rlfleet.sandbox.bwrap_command import ExecGate
from rlfleet.sandbox.errors import SandboxDriverUnavailable
from rlfleet.sandbox.limits import KiB, MiB

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("bwrap"), reason="needs root and bubblewrap"),
]

V = ViolationKind


async def assert_still_works(driver: BubblewrapDriver, *handles) -> None:
    """The driver serves a fresh sandbox, the attacked ones still run, and nothing was left running."""
    fresh = await driver.create()
    try:
        for h in (fresh, *handles):
            result = await driver.exec(h, ["python3", "-c", "print(6 * 7)"])
            assert result.ok, result
            assert result.stdout == b"42\n"
    finally:
        await driver.destroy(fresh)
    for h in handles:
        uid = driver.host_info(h)["uid"]
        assert not _processes_of(uid), f"processes of sandbox uid {uid} outlived their exec"


def _processes_of(uid: int) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def exists(path: str | Path) -> bool:
    return Path(path).exists()


def read_host_file(path: str) -> bytes:
    return Path(path).read_bytes()


def py(code: str) -> list[str]:
    return ["python3", "-c", textwrap.dedent(code)]


async def test_connecting_to_a_port_the_host_listens_on_fails_and_the_host_sees_nothing(driver):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.setblocking(False)
        port = server.getsockname()[1]
        h = await driver.create()
        result = await driver.exec(
            h,
            py(f"""
                import socket
                for host in ("127.0.0.1", "10.255.255.1"):
                    try:
                        socket.create_connection((host, {port}), timeout=2)
                        print("connected", host)
                    except OSError as e:
                        print(host, e)
                        import sys; print(f"{{host}}: {{e}}", file=sys.stderr)
            """),
        )
        assert b"connected" not in result.stdout
        assert b"127.0.0.1 [Errno 111] Connection refused" in result.stdout  # its own empty loopback
        assert b"Network is unreachable" in result.stdout  # no route anywhere else
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing ever reached the host's socket
    network = [v for v in result.violations if v.kind == V.NETWORK]
    assert network and network[0].inferred  # only the unreachable error is visible from outside
    await assert_still_works(driver, h)


async def test_writes_outside_the_workspace_fail_and_leave_the_host_untouched(driver, tmp_path):
    marker = f"rlfleet-escape-{uuid.uuid4().hex}"
    host_tmp_target = Path("/tmp") / marker
    targets = [
        f"/etc/{marker}",
        f"/usr/{marker}",
        f"/usr/bin/{marker}",
        f"/{marker}",
        f"/root/{marker}",
        f"/work/../{marker}",
        str(driver.config.root / marker),
        str(tmp_path / marker),
    ]
    h = await driver.create()
    result = await driver.exec(
        h,
        py(f"""
            import sys
            for t in {targets!r}:
                try:
                    open(t, "w").write("x")
                    print("WROTE", t)
                except OSError as e:
                    print(f"{{t}}: {{e}}", file=sys.stderr)
            open({str(host_tmp_target)!r}, "w").write("private")  # lands in the sandbox's own /tmp
            print("tmp ok")
        """),
    )
    assert b"WROTE" not in result.stdout, result.stdout
    assert result.stdout.endswith(b"tmp ok\n")
    assert result.stderr.count(b"Read-only file system") + result.stderr.count(b"No such file") >= len(
        targets
    )
    assert any(v.kind == V.FILESYSTEM and v.inferred for v in result.violations)
    assert not [t for t in targets if exists(t)]
    assert not exists(host_tmp_target)
    # The private /tmp dies with the exec: the next exec in the same sandbox starts clean.
    again = await driver.exec(h, ["ls", "-A", "/tmp"])
    assert again.stdout == b""
    await assert_still_works(driver, h)


async def test_another_sandbox_and_hidden_host_files_are_invisible(driver, tmp_path):
    secret = uuid.uuid4().hex
    hidden = tmp_path / "hidden_tests"  # stands in for the verifier's tests
    hidden.mkdir()
    (hidden / "test_answer.py").write_text(f"assert answer == {secret!r}\n")
    victim = await driver.create(SandboxSpec(files={"secret.txt": secret}))
    victim_ws = driver.host_info(victim)["workspace"]
    attacker = await driver.create()
    probes = [
        str(hidden / "test_answer.py"),
        str(hidden),
        str(victim_ws / "secret.txt"),
        str(driver.config.root),
        "/work/../" + victim.id,
        "/root/.bash_history",
        "/etc/shadow",
        "/proc/1/root/etc/shadow",
    ]
    result = await driver.exec(
        attacker,
        py(f"""
            import os
            for p in {probes!r}:
                try:
                    print(p, "READABLE" if os.path.isfile(p) and open(p).read() else "exists" if os.path.exists(p) else "absent")
                except OSError as e:
                    print(p, "denied", e.errno)
            print("ROOT", sorted(os.listdir("/")))
            print("PROC", sorted(p for p in os.listdir("/proc") if p.isdigit()))
        """),  # noqa: E501 (the probe script's text)
    )
    out = result.stdout_text
    assert "READABLE" not in out and secret not in out, out
    for p in probes[:4]:
        assert f"{p} absent" in out, out
    root = eval(out.split("ROOT ", 1)[1].splitlines()[0])
    assert set(root) <= {
        "bin",
        "dev",
        "etc",
        "lib",
        "lib32",
        "lib64",
        "libx32",
        "proc",
        "root",
        "sbin",
        "tmp",
        "usr",
        "work",
    }
    # Its own pid namespace: only the init, the program and nothing of the host's ~100 processes.
    assert len(eval(out.split("PROC ", 1)[1].splitlines()[0])) <= 3
    await assert_still_works(driver, victim, attacker)


async def test_a_fork_bomb_is_capped_at_max_processes_and_killed_at_the_deadline(any_mode_driver):
    driver = any_mode_driver
    h = await driver.create(SandboxSpec(limits=Limits(max_processes=16, wall_seconds=3, cpu_seconds=5)))
    result = await driver.exec(
        h,
        py("""
            import os, sys, time
            for _ in range(64):
                try:
                    if os.fork() == 0:
                        continue  # children fork too: exponential growth until the limit
                except OSError as e:
                    print(f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
                    break
            time.sleep(60)
        """),
    )
    assert result.has(V.TIMEOUT)
    processes = [v for v in result.violations if v.kind == V.PROCESSES]
    assert processes, result
    if driver.uses_cgroups:
        assert not processes[0].inferred  # pids.events counted the refused forks
    assert result.duration_s < 10
    await assert_still_works(driver, h)


async def test_process_limit_allows_exactly_max_processes(driver):
    h = await driver.create(SandboxSpec(limits=Limits(max_processes=8, wall_seconds=10)))
    result = await driver.exec(
        h,
        py("""
            import os, time
            kids = []
            try:
                while True:
                    pid = os.fork()
                    if pid == 0:
                        time.sleep(5); os._exit(0)
                    kids.append(pid)
            except OSError:
                pass
            print(len(kids) + 1)
            for k in kids: os.kill(k, 9)
        """),
    )
    assert result.stdout == b"8\n", result
    assert result.has(V.PROCESSES)


async def test_a_memory_hog_is_stopped_and_recorded_as_memory(any_mode_driver):
    driver = any_mode_driver
    h = await driver.create(SandboxSpec(limits=Limits(memory_bytes=64 * MiB, wall_seconds=15)))
    result = await driver.exec(
        h,
        py("""
            chunks = []
            for _ in range(64):
                chunks.append(b"x" * (16 << 20))  # touched, not just reserved
            print("allocated", len(chunks) * 16, "MiB")
        """),
    )
    assert b"allocated" not in result.stdout
    assert result.exit_code != 0
    memory = [v for v in result.violations if v.kind == V.MEMORY]
    assert memory, result
    if driver.uses_cgroups:
        assert not memory[0].inferred and result.signal == 9  # OOM-killed, counted by the cgroup
        assert result.max_rss_bytes <= 64 * MiB
    else:
        assert b"MemoryError" in result.stderr  # RLIMIT_AS makes the allocation fail instead
    await assert_still_works(driver, h)


async def test_an_endless_loop_is_stopped_by_the_cpu_limit(driver):
    h = await driver.create(SandboxSpec(limits=Limits(cpu_seconds=1, wall_seconds=10)))
    result = await driver.exec(h, py("while True: pass"))
    assert result.signal == 24  # SIGXCPU
    cpu = [v for v in result.violations if v.kind == V.CPU]
    assert cpu and not cpu[0].inferred
    assert 0.9 <= result.cpu_s < 3
    assert not result.has(V.TIMEOUT)
    await assert_still_works(driver, h)


async def test_a_sleeping_or_blocked_program_is_stopped_by_the_wall_clock(driver):
    h = await driver.create(SandboxSpec(limits=Limits(cpu_seconds=10, wall_seconds=1)))
    result = await driver.exec(h, ["sh", "-c", "sleep 100 & sleep 100"])
    assert result.has(V.TIMEOUT) and result.signal == 9 and result.exit_code == 137
    assert 0.9 <= result.duration_s < 5
    assert not result.has(V.CPU)
    await assert_still_works(driver, h)


async def test_an_exec_timeout_overrides_the_sandbox_wall_limit(driver):
    h = await driver.create(SandboxSpec(limits=Limits(wall_seconds=60)))
    result = await driver.exec(h, ["sleep", "30"], timeout=0.5)
    assert result.has(V.TIMEOUT) and result.duration_s < 5


async def test_an_output_flood_is_capped_and_recorded(driver):
    h = await driver.create(SandboxSpec(limits=Limits(max_output_bytes=64 * KiB, wall_seconds=15)))
    result = await driver.exec(
        h, py("import sys; sys.stdout.buffer.write(b'x' * (32 << 20)); print('done', file=sys.stderr)")
    )
    assert result.exit_code == 0
    assert len(result.stdout) == 64 * KiB and result.stdout_truncated
    assert result.stderr == b"done\n" and not result.stderr_truncated
    output = [v for v in result.violations if v.kind == V.OUTPUT]
    assert output and not output[0].inferred and str(32 << 20) in output[0].message
    await assert_still_works(driver, h)


async def test_an_endless_output_flood_is_capped_and_stopped_at_the_deadline(driver):
    h = await driver.create(SandboxSpec(limits=Limits(max_output_bytes=16 * KiB, wall_seconds=2)))
    result = await driver.exec(h, ["sh", "-c", "yes 1>&2 & yes"])
    assert result.has(V.TIMEOUT) and result.has(V.OUTPUT)
    assert len(result.stdout) == 16 * KiB and len(result.stderr) == 16 * KiB
    assert result.duration_s < 8
    await assert_still_works(driver, h)


async def test_a_file_over_max_file_bytes_is_cut_off(driver):
    h = await driver.create(SandboxSpec(limits=Limits(max_file_bytes=1 * MiB)))
    result = await driver.exec(h, ["sh", "-c", "head -c 4M /dev/zero > big"])
    assert result.signal == 25 and result.has(V.FILE_SIZE)  # SIGXFSZ
    # Python ignores SIGXFSZ and gets EFBIG instead: visible only in its error message.
    result = await driver.exec(h, py("open('big2', 'wb').write(b'x' * (4 << 20))"))
    assert result.exit_code == 1 and any(v.kind == V.FILE_SIZE and v.inferred for v in result.violations)
    sizes = {f.path: f.size for f in await driver.list_files(h)}
    assert sizes["big"] == sizes["big2"] == 1 * MiB
    await assert_still_works(driver, h)


async def test_filling_the_private_tmp_stops_at_its_size(driver_factory):
    async with driver_factory(tmp_size_bytes=4 * MiB) as driver:
        h = await driver.create()
        result = await driver.exec(h, ["sh", "-c", "head -c 16M /dev/zero > /tmp/fill"])
        assert result.exit_code != 0
        assert any(v.kind == V.FILESYSTEM for v in result.violations)
        await assert_still_works(driver, h)


async def test_privileges_are_gone_inside_the_sandbox(driver):
    h = await driver.create()
    result = await driver.exec(
        h, ["sh", "-c", "grep -E '^(Cap(Prm|Eff|Bnd|Amb)|NoNewPrivs|Seccomp):' /proc/self/status; id -u"]
    )
    lines = result.stdout_text.splitlines()
    assert all(line.endswith("0000000000000000") for line in lines if line.startswith("Cap")), lines
    assert "NoNewPrivs:\t1" in lines
    assert "Seccomp:\t2" in lines  # a filter is loaded
    assert int(lines[-1]) == driver.host_info(h)["uid"]
    await assert_still_works(driver, h)


async def test_user_namespaces_and_risky_kernel_interfaces_are_refused(driver):
    h = await driver.create()
    result = await driver.exec(
        h,
        py("""
            import ctypes, os
            libc = ctypes.CDLL(None, use_errno=True)
            for name, nr, args in [("unshare(CLONE_NEWUSER)", 272, (0x10000000,)), ("keyctl", 250, (0, 0, 0, 0, 0)),
                                   ("bpf", 321, (0, 0, 0)), ("perf_event_open", 298, (0, 0, -1, -1, 0)),
                                   ("io_uring_setup", 425, (1, 0))]:
                rc = libc.syscall(nr, *args)
                print(name, rc, os.strerror(ctypes.get_errno()))
            import threading, subprocess  # clone3 falls back to clone: threads and processes still work
            t = threading.Thread(target=lambda: None); t.start(); t.join()
            print("children", subprocess.run(["true"]).returncode)
        """),  # noqa: E501 (the probe script's text)
    )
    if os.uname().machine != "x86_64":
        pytest.skip("the probe uses x86_64 syscall numbers")
    out = result.stdout_text.splitlines()
    assert all(line.endswith("-1 Operation not permitted") for line in out[:-1]), out
    assert out[-1] == "children 0"
    shell = await driver.exec(h, ["unshare", "-r", "true"])
    assert shell.exit_code != 0 and b"Operation not permitted" in shell.stderr
    await assert_still_works(driver, h)


async def test_no_host_file_descriptors_leak_into_the_sandbox(driver):
    leaked = os.open("/etc/hostname", os.O_RDONLY)  # inheritable, as a careless host library might leave one
    os.set_inheritable(leaked, True)
    try:
        h = await driver.create()
        result = await driver.exec(
            h, ["python3", "-c", "import os; print(sorted(os.listdir('/proc/self/fd')))"]
        )
    finally:
        os.close(leaked)
    assert result.stdout_text.strip() in ("['0', '1', '2']", "['0', '1', '2', '3']"), result.stdout_text


async def test_symlinks_planted_in_the_workspace_do_not_redirect_host_file_access(driver):
    h = await driver.create()
    await driver.exec(
        h, ["sh", "-c", "ln -s /etc etc_link && ln -s /etc/hostname hostname_link && mkdir d && ln -s / d/up"]
    )
    before = read_host_file("/etc/hostname")
    for path in ("etc_link/hostname", "hostname_link", "d/up/etc/hostname"):
        with pytest.raises(InvalidSandboxRequest):
            await driver.write_files(h, {path: b"owned"})
        with pytest.raises(InvalidSandboxRequest):
            await driver.read_files(h, [path])
    assert read_host_file("/etc/hostname") == before
    kinds = {f.path: f.kind for f in await driver.list_files(h)}
    assert kinds["etc_link"] == "symlink" and "etc_link/hostname" not in kinds  # listed, not followed
    await assert_still_works(driver, h)


async def test_the_program_runs_under_the_exec_rlimits_as_the_sandbox_uid(any_mode_driver):
    """The driver puts rlimits on bwrap's sandbox process (no prlimit in the chain): the program
    inherits exactly them, in both modes (RLIMIT_AS only without a memory cgroup)."""
    driver = any_mode_driver
    h = await driver.create(
        SandboxSpec(limits=Limits(cpu_seconds=3, max_processes=12, max_file_bytes=5000,
                                  memory_bytes=96 * MiB))
    )
    result = await driver.exec(
        h,
        py("""
            import os, resource as r
            for name in ("CPU", "FSIZE", "NPROC", "CORE", "NOFILE", "AS"):
                print(name, *r.getrlimit(getattr(r, "RLIMIT_" + name)))
            print("uid", os.getuid(), os.geteuid(), os.getgid(), os.getgroups())
        """),
    )
    assert result.ok, result
    got = {line.split()[0]: line.split()[1:] for line in result.stdout_text.splitlines()}
    assert got["CPU"] == ["3", "4"]
    assert got["FSIZE"] == ["5000", "5000"]
    nproc = 12 + driver._host.init_tasks() + (1 if driver.uses_cgroups else 0)
    assert got["NPROC"] == [str(nproc)] * 2
    assert got["CORE"] == ["0", "0"] and got["NOFILE"] == ["1024", "1024"]
    unlimited = str(resource.RLIM_INFINITY)
    assert got["AS"] == ([unlimited] * 2 if driver.uses_cgroups else [str(96 * MiB)] * 2)
    uid = driver.host_info(h)["uid"]
    assert got["uid"] == [str(uid), str(uid), str(uid), "[]"]
    await assert_still_works(driver, h)


async def test_the_program_and_its_children_run_in_the_exec_cgroup(driver):
    if not driver.uses_cgroups:
        pytest.skip("cgroups are not available on this host")
    h = await driver.create()
    uid = driver.host_info(h)["uid"]
    task = asyncio.create_task(driver.exec(h, ["sh", "-c", "sleep 5 & sleep 5; wait"]))
    try:
        for _ in range(200):
            pids = _processes_of(uid)
            if len(pids) >= 4:  # tini, sh and two sleeps
                break
            await asyncio.sleep(0.02)
        assert len(pids) >= 4, pids
        for pid in pids:
            groups = read_host_file(f"/proc/{pid}/cgroup").decode().splitlines()
            memory = next(g.split(":", 2)[2] for g in groups if ":memory:" in g or g.startswith("0::"))
            assert f"/sbx-{h.id}/exec-" in memory, (pid, groups)
    finally:
        await driver.destroy(h)
        with contextlib.suppress(Exception):
            await task


async def test_an_exec_whose_gate_is_not_opened_never_runs_the_program(driver, monkeypatch):
    """If the driver gives up (or dies) before the limits are on, bwrap exits on the empty
    filter: the program never starts."""
    h = await driver.create()

    def give_up(self, bwrap_pid, status):  # closes the pipe without writing the filter
        self.close()
        return True

    monkeypatch.setattr(ExecGate, "on_status", give_up)
    with pytest.raises(SandboxDriverUnavailable) as e:
        await driver.exec(h, ["sh", "-c", "touch ran"])
    assert e.value.reason == "sandbox_setup_failed"
    monkeypatch.undo()
    assert "ran" not in {f.path for f in await driver.list_files(h)}
    await assert_still_works(driver, h)


async def test_etc_is_the_synthesised_one_and_read_only(driver):
    h = await driver.create()
    result = await driver.exec(
        h,
        ["sh", "-c", "id -un; grep -c . /etc/passwd; test -s /etc/ld.so.cache && echo cache; "
         "echo x >> /etc/passwd || echo refused; ls /etc/alternatives >/dev/null && echo alt; "
         "stat -c %U /etc/passwd; awk '$2 == \"/\" {print substr($4, 1, 3)}' /proc/self/mounts"],
    )
    lines = result.stdout_text.splitlines()
    # Copied files are root's, on the root tmpfs, which is read-only once set up.
    assert lines == ["sandbox", "3", "cache", "refused", "alt", "root", "ro,"], (lines, result.stderr_text)
    await assert_still_works(driver, h)
