"""Run one process tree with a wall-clock deadline, capped output capture and kernel rusage.

Independent of bubblewrap so that it can be tested on plain processes. Three properties matter:
- output beyond the cap is still *read* (and dropped): a program flooding stdout must neither block
  on a full pipe (turning a flood into a fake timeout) nor grow the driver's memory;
- the child is reaped with wait4, so CPU time and peak RSS are the kernel's figures for the whole
  tree of descendants that were waited for, not estimates;
- on timeout or cancellation the tree is stopped and the child reaped before returning, so nothing
  outlives the call. The caller may pass `stop` to end the tree its own way first (the sandbox
  kills its pid-namespace init, so bwrap exits normally); SIGKILL of the process group follows if
  that fails or takes too long. The child's pid is only signalled while unreaped, so it cannot
  have been reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

_CHUNK = 1 << 16
# After a kill, how long to wait for pipes to reach EOF (every writer is dead by then unless
# something escaped the process group; we then stop reading rather than hang).
_DRAIN_AFTER_KILL_S = 5.0
_TAIL = 8192
# How long a caller's `stop` gets before the process group is SIGKILLed.
_STOP_GRACE_S = 2.0


@dataclass(frozen=True, slots=True)
class Captured:
    data: bytes  # the first `cap` bytes
    total_bytes: int
    tail: bytes = b""  # the last _TAIL bytes, kept even when truncated (errors come last)

    @property
    def truncated(self) -> bool:
        return self.total_bytes > len(self.data)


@dataclass(frozen=True, slots=True)
class ProcessOutcome:
    wait_status: int
    rusage: resource.struct_rusage
    stdout: Captured
    stderr: Captured
    status_data: bytes  # what the child wrote to the extra status fd, if one was asked for
    timed_out: bool
    duration_s: float

    @property
    def exit_code(self) -> int:
        """Shell convention: exit status, or 128+N for death by signal N."""
        s = self.wait_status
        return os.WEXITSTATUS(s) if os.WIFEXITED(s) else 128 + os.WTERMSIG(s)

    @property
    def cpu_s(self) -> float:
        return self.rusage.ru_utime + self.rusage.ru_stime

    @property
    def max_rss_bytes(self) -> int:
        return self.rusage.ru_maxrss * 1024  # Linux reports KiB


class _Sink:
    """Reads a non-blocking pipe as it becomes readable, keeping at most `cap` bytes."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        fd: int,
        cap: int,
        on_data: Callable[[], None] | None = None,
    ) -> None:
        self.loop, self.fd, self.cap, self.on_data = loop, fd, cap, on_data
        self.buf = bytearray()
        self.tail = bytearray()
        self.total = 0
        self.done = loop.create_future()
        os.set_blocking(fd, False)
        loop.add_reader(fd, self.drain)

    def drain(self) -> None:
        """Read what is available now (called by the loop, or directly to be up to date)."""
        if self.done.done():
            return
        got = False
        try:
            # A few reads per wakeup: a flood is drained quickly without starving the loop.
            for _ in range(16):
                try:
                    data = os.read(self.fd, _CHUNK)
                except BlockingIOError:
                    return
                if not data:
                    self.stop()
                    return
                got = True
                self.total += len(data)
                room = self.cap - len(self.buf)
                if room > 0:
                    self.buf += data[:room]
                self.tail += data[-_TAIL:]
                del self.tail[:-_TAIL]
        finally:
            if got and self.on_data is not None:
                self.on_data()

    def stop(self) -> None:
        if not self.done.done():
            self.loop.remove_reader(self.fd)
            self.done.set_result(None)

    def result(self) -> Captured:
        return Captured(bytes(self.buf), self.total, bytes(self.tail))


class _Child:
    """A spawned child we reap ourselves (Popen is only used for its careful fd setup)."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        loop: asyncio.AbstractEventLoop,
        stop: Callable[[int], bool] | None,
    ) -> None:
        self.proc, self.pid, self.loop = proc, proc.pid, loop
        self._stop = stop
        self.exited = loop.create_future()
        self.reaped: tuple[int, resource.struct_rusage] | None = None
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(self.pid)
            loop.add_reader(self._pidfd, self._try_reap)
        except OSError:  # kernel without pidfd (< 5.3): poll instead
            self._poller = loop.create_task(self._poll())

    async def _poll(self) -> None:
        while self.reaped is None:
            self._try_reap()
            await asyncio.sleep(0.01)

    def _try_reap(self) -> None:
        if self.reaped is not None:
            return
        pid, status, usage = os.wait4(self.pid, os.WNOHANG)
        if pid == 0:
            return
        self._set_reaped(status, usage)

    def _set_reaped(self, status: int, usage: resource.struct_rusage) -> None:
        self.reaped = (status, usage)
        self.proc.returncode = os.waitstatus_to_exitcode(status)  # so Popen never waits on it again
        if self._pidfd is not None:
            self.loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if not self.exited.done():
            self.exited.set_result(None)

    def kill(self) -> None:
        """Stop the tree: the caller's way first, the process group's SIGKILL if that fails or
        has not finished within the grace period."""
        if self.reaped is not None:
            return
        stop, self._stop = self._stop, None  # tried once
        if stop is not None and stop(self.pid):
            self.loop.call_later(_STOP_GRACE_S, self._hard_kill)
        else:
            self._hard_kill()

    def _hard_kill(self) -> None:
        if self.reaped is None:  # an unreaped pid (even a zombie) cannot have been reused
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def kill_and_reap_now(self) -> None:
        """Synchronous last resort (cancellation): stop, wait briefly, then SIGKILL and reap."""
        if self.reaped is not None:
            return
        self.kill()
        deadline = time.monotonic() + _STOP_GRACE_S
        while self.reaped is None and time.monotonic() < deadline:
            self._try_reap()
            time.sleep(0.002)
        if self.reaped is None:
            self._hard_kill()
            _, status, usage = os.wait4(self.pid, 0)
            self._set_reaped(status, usage)


async def run_captured(
    argv_for: Callable[[int | None], Sequence[str]],
    *,
    env: Mapping[str, str],
    stdin: bytes,
    timeout_s: float,
    max_output_bytes: int,
    status_fd: bool = False,
    on_spawn: Callable[[Callable[[], None]], None] | None = None,
    stop: Callable[[int, bytes], bool] | None = None,
    pass_fds: Sequence[int] = (),
    on_status: Callable[[int, bytes], bool | asyncio.Future[None]] | None = None,
) -> ProcessOutcome:
    """Run `argv_for(fd)` (fd: the write end of a status pipe, if asked) and collect its outcome.

    `on_spawn` receives a callable that kills the running tree, for callers that must be able to
    stop it from elsewhere (destroying a sandbox mid-exec). `stop(pid, status_so_far)` is tried
    first whenever the tree must be killed; it returns whether it did something. `pass_fds` are
    more fds the child inherits (the caller keeps and closes them). `on_status(pid, status_so_far)`
    is called on the loop each time the status pipe has new data, until it returns True or a
    future; if it raises (or its future fails), the tree is killed and reaped and the exception
    propagates.
    """
    loop = asyncio.get_running_loop()
    to_close: list[int] = []
    sinks: list[_Sink] = []
    child: _Child | None = None
    try:
        # stdin from a memfd: the child reads at its own pace and we never block writing to it.
        stdin_fd = os.memfd_create("rlfleet-stdin", os.MFD_CLOEXEC)
        to_close.append(stdin_fd)
        view = memoryview(stdin)
        while view:
            view = view[os.write(stdin_fd, view) :]
        os.lseek(stdin_fd, 0, os.SEEK_SET)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        to_close += [out_r, out_w, err_r, err_w]
        st_r = st_w = None
        if status_fd:
            st_r, st_w = os.pipe()
            to_close += [st_r, st_w]
        # close_fds (the default) keeps fds the driver inherited out of the sandbox; a new session
        # gives one process group to kill. Popen only forks/execs here (no waiting): reaping is
        # ours, through a pidfd on the loop.
        proc = subprocess.Popen(  # noqa: ASYNC220
            list(argv_for(st_w)),
            stdin=stdin_fd,
            stdout=out_w,
            stderr=err_w,
            pass_fds=(*pass_fds, *((st_w,) if st_w is not None else ())),
            env=dict(env),
            start_new_session=True,
        )
        started = time.monotonic()
        status_sink: list[_Sink] = []
        child = _Child(
            proc,
            loop,
            (lambda pid: stop(pid, _snapshot(status_sink))) if stop else None,
        )
        for fd in (stdin_fd, out_w, err_w, st_w):
            if fd is not None:
                to_close.remove(fd)
                os.close(fd)
        sinks = [_Sink(loop, out_r, max_output_bytes), _Sink(loop, err_r, max_output_bytes)]
        hook_failed: list[BaseException] = []
        if st_r is not None:
            on_data = None
            if on_status is not None:
                hook_done = False
                spawned = child

                def failed(e: BaseException) -> None:  # surfaced after the tree is stopped
                    hook_failed.append(e)
                    spawned.kill()

                def hook_finished(f: asyncio.Future[None]) -> None:
                    error = None if f.cancelled() else f.exception()
                    if error is not None:
                        failed(error)

                def on_data() -> None:
                    nonlocal hook_done
                    if hook_done or hook_failed:
                        return
                    try:
                        done = on_status(spawned.pid, bytes(status_sink[0].buf))
                    except Exception as e:
                        failed(e)
                        return
                    if isinstance(done, asyncio.Future):
                        hook_done = True
                        done.add_done_callback(hook_finished)
                    else:
                        hook_done = done

            sinks.append(_Sink(loop, st_r, 1 << 16, on_data))
            status_sink.append(sinks[-1])
        if on_spawn is not None:
            on_spawn(child.kill)

        waiting = asyncio.gather(child.exited, *(s.done for s in sinks))
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(waiting), timeout_s)
        except TimeoutError:
            timed_out = True
            child.kill()
            try:
                await asyncio.wait_for(asyncio.shield(waiting), _DRAIN_AFTER_KILL_S)
            except TimeoutError:
                child.kill_and_reap_now()
                for s in sinks:
                    s.stop()
        if hook_failed:
            raise hook_failed[0]
        duration = time.monotonic() - started
        assert child.reaped is not None
        status, usage = child.reaped
        captured = [s.result() for s in sinks]
        return ProcessOutcome(
            wait_status=status,
            rusage=usage,
            stdout=captured[0],
            stderr=captured[1],
            status_data=captured[2].data if status_fd else b"",
            timed_out=timed_out,
            duration_s=duration,
        )
    finally:
        if child is not None:
            child.kill_and_reap_now()  # no-op when already reaped
        for s in sinks:
            s.stop()
        for fd in to_close:
            os.close(fd)


def _snapshot(sinks: list[_Sink]) -> bytes:
    """Everything the status pipe has said so far, including what the loop has not read yet."""
    if not sinks:
        return b""
    sinks[0].drain()
    return bytes(sinks[0].buf)
