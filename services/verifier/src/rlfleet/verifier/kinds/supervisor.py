"""The hidden-test supervisor: runs inside the hidden-tests sandbox as ``python3 -I -c <this file>``.

Stdlib only, and never imported by the verifier (whose process must not run it): the verifier reads
this file's text and hands it to the sandbox. What it does, and why:

- It makes itself non-dumpable first (``prctl(PR_SET_DUMPABLE, 0)``): a process of the same uid
  can then neither ptrace it nor open its ``/proc/<pid>/{mem,fd,environ}``, so candidate code
  cannot read its memory (the hidden tests, the nonce) nor write to its stdout.
- It reads its job from stdin (the hidden test script, the per-run nonce, the time budget): the
  hidden tests are never written to the sandbox's disk.
- It runs the hidden script in its own process with each candidate module (``solution``) replaced
  by a proxy: every call of a candidate function runs in a *fresh* worker process (``python3 -I``),
  which gets the arguments as data and sends back the return value as data, over a pipe of its
  own. The comparison with the expected value happens here, on values decoded from that data, so
  candidate objects (an ``__eq__`` that is always true), patched builtins or ``math``, prints,
  exit codes, ``atexit`` handlers and signals of the worker reach nothing but that one call.
- Imports of the script are confined to the interpreter's own paths: a ``json.py`` the candidate
  leaves in the workspace is never imported here.
- Each call's outcome (``ok``, ``EXCEPTION``, ``TIMEOUT``, ``REWARD_HACKING``, ``SAFETY_VIOLATION``,
  ``CRASHED``) is recorded against the script's next output line, and the whole run is reported
  as one line ``RLFLEET-HARNESS-REPORT <nonce> <json>`` on a duplicate of the original stdout that
  no worker inherits.
"""

import builtins
import ctypes
import importlib.abc
import importlib.machinery
import json
import os
import re
import select
import signal
import subprocess
import sys
import time

REPORT_TAG = "RLFLEET-HARNESS-REPORT"
MAX_REPLY = 1 << 20  # bytes of one worker's reply
MAX_CANDIDATE_OUTPUT = 64 << 10  # bytes of one worker's stdout+stderr kept (to look for protocol lines)
MAX_LINES = 200
MAX_LINE = 240
PROTOCOL_RE = re.compile(rb"^(PASS |FAIL |RESULT |FAILED |RLFLEET-HARNESS-REPORT)", re.M)
NAME_RE = re.compile(r"[^A-Za-z0-9_.]")
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f\u2028\u2029\x85]")

WORKER = r'''
import json, os, sys
def decode(v):
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, list):
        return [decode(x) for x in v]
    (tag, x), = v.items()
    if tag == "int": return int(x)
    if tag == "float": return float(x)
    if tag == "bytes": return bytes.fromhex(x)
    if tag == "tuple": return tuple(decode(y) for y in x)
    if tag == "set": return {decode(y) for y in x}
    if tag == "frozenset": return frozenset(decode(y) for y in x)
    if tag == "dict": return {decode(k): decode(y) for k, y in x}
    if tag == "complex": return complex(*x)
    raise ValueError(tag)
def encode(v):
    t = type(v)
    if v is None or t is bool or t is str: return v
    if t is int: return {"int": str(v)}
    if t is float: return {"float": repr(v)}
    if t is bytes: return {"bytes": v.hex()}
    if t is list: return [encode(x) for x in v]
    if t is tuple: return {"tuple": [encode(x) for x in v]}
    if t is set: return {"set": [encode(x) for x in v]}
    if t is frozenset: return {"frozenset": [encode(x) for x in v]}
    if t is dict: return {"dict": [[encode(k), encode(x)] for k, x in v.items()]}
    if t is complex: return {"complex": [v.real, v.imag]}
    raise TypeError(t.__module__ + "." + t.__qualname__)
reply = os.fdopen(int(sys.argv[1]), "w")
job = json.loads(sys.stdin.read())
args, kwargs = decode(job["args"]), decode(job["kwargs"])
sys.path.insert(0, job["workdir"])
os.chdir(job["workdir"])
def send(message):
    reply.write(json.dumps(message)); reply.flush(); reply.close()
try:
    import importlib
    value = getattr(importlib.import_module(job["module"]), job["attr"])(*args, **kwargs)
except BaseException as exc:
    try:
        text = str(exc)[:300]
    except BaseException:
        text = ""
    send({"raised": type(exc).__name__[:64], "message": text})
else:
    try:
        encoded = encode(value)
    except TypeError as exc:
        send({"not_data": str(exc)[:120]})
    else:
        send({"value": encoded})
'''


def encode(v, depth=0):
    if depth > 64:
        raise ValueError("nested too deep")
    t = type(v)
    if v is None or t is bool or t is str:
        return v
    if t is int:
        return {"int": str(v)}
    if t is float:
        return {"float": repr(v)}
    if t is bytes:
        return {"bytes": v.hex()}
    if t is list:
        return [encode(x, depth + 1) for x in v]
    if t is tuple:
        return {"tuple": [encode(x, depth + 1) for x in v]}
    if t in (set, frozenset):
        return {t.__name__: [encode(x, depth + 1) for x in v]}
    if t is dict:
        return {"dict": [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in v.items()]}
    if t is complex:
        return {"complex": [v.real, v.imag]}
    raise TypeError(f"a {t.__name__} is not plain data")


def decode(v, depth=0):
    """Plain Python values from a worker's reply; anything else raises ValueError."""
    if depth > 64:
        raise ValueError("nested too deep")
    if v is None or type(v) in (bool, str):
        return v
    if type(v) is list:
        return [decode(x, depth + 1) for x in v]
    if type(v) is not dict or len(v) != 1:
        raise ValueError("not an encoded value")
    ((tag, x),) = v.items()
    if tag == "int" and type(x) is str and re.fullmatch(r"-?\d{1,4000}", x):
        return int(x)
    if tag == "float" and type(x) is str and len(x) < 40:
        return float(x)
    if tag == "bytes" and type(x) is str:
        return bytes.fromhex(x)
    if tag in ("tuple", "set", "frozenset") and type(x) is list:
        items = [decode(y, depth + 1) for y in x]
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
    if tag == "dict" and type(x) is list and all(type(p) is list and len(p) == 2 for p in x):
        return {decode(k, depth + 1): decode(y, depth + 1) for k, y in x}
    if tag == "complex" and type(x) is list and len(x) == 2 and all(type(p) in (int, float) for p in x):
        return complex(*x)
    raise ValueError(f"unknown tag {tag[:20]!r}")


class CandidateError(Exception):
    """A candidate call that did not return a value; ``code`` says why."""

    code = "EXCEPTION"


class CandidateTimeout(CandidateError):
    code = "TIMEOUT"


class CandidateCheating(CandidateError):
    code = "REWARD_HACKING"


class CandidateUnsafe(CandidateError):
    code = "SAFETY_VIOLATION"


class CandidateCrashed(CandidateError):
    code = "CRASHED"


_raised_types: dict[str, type[CandidateError]] = {}


def raised_type(name):
    """An exception class named like the candidate's (sanitised), so scripts print a familiar name."""
    name = NAME_RE.sub("_", name)[:64].rsplit(".", 1)[-1] or "Exception"
    if name not in _raised_types:
        # A built-in exception's name gives a subclass of it too, so `except ValueError` in the
        # hidden tests (a test that expects the candidate to raise) still matches.
        builtin = getattr(builtins, name, None)
        bases: tuple[type[Exception], ...] = (CandidateError,)
        if isinstance(builtin, type) and issubclass(builtin, Exception) and builtin is not Exception:
            bases = (builtin, CandidateError)
        try:
            _raised_types[name] = type(name, bases, {"code": "EXCEPTION"})
        except TypeError:  # a layout the two bases cannot share
            _raised_types[name] = type(name, (CandidateError,), {"code": "EXCEPTION"})
    return _raised_types[name]


class Run:
    def __init__(self, job):
        self.workdir = os.path.realpath(job.get("workdir") or os.getcwd())
        self.deadline = time.monotonic() + float(job["timeout_s"])
        self.call_timeout_s = float(job.get("call_timeout_s") or job["timeout_s"])
        self.pending = []  # outcomes of calls since the script's last output line
        self.outcomes = {}
        self.calls = 0
        self.details = []  # (code, detail) of failed calls, in order, at most MAX_LINES
        self.baseline = set(other_pids())
        # In the sandbox's own pid namespace every process but our ancestors is a leftover; on a
        # shared host (a local run) only those still in the worker's session are.
        self.own_namespace = self.baseline <= ancestors()

    def record(self, code, detail=""):
        self.pending.append(code)
        self.outcomes[code] = self.outcomes.get(code, 0) + 1
        if code != "ok" and len(self.details) < MAX_LINES:
            self.details.append({"code": code, "detail": str(detail)[:MAX_LINE]})

    def call(self, module, attr, args, kwargs):
        self.calls += 1
        try:
            job = json.dumps({"module": module, "attr": attr, "args": encode(list(args)),
                              "kwargs": encode(dict(kwargs)), "workdir": self.workdir})
        except (TypeError, ValueError) as exc:
            raise RuntimeError(f"the hidden tests passed an argument that is not plain data: {exc}") from None
        remaining = min(self.deadline - time.monotonic(), self.call_timeout_s)
        if remaining <= 0:
            self.record("TIMEOUT", "no time left")
            raise CandidateTimeout("the candidate ran out of time")
        reply_r, reply_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", WORKER, str(reply_w)], stdin=subprocess.PIPE, stdout=out_w,
                stderr=out_w, pass_fds=(reply_w,), cwd=self.workdir, start_new_session=True,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": self.workdir,
                     "LANG": "C.UTF-8"})
        finally:
            os.close(reply_w)
            os.close(out_w)
        assert proc.stdin is not None  # stdin=PIPE
        try:
            proc.stdin.write(job.encode())
            proc.stdin.close()
        except OSError:
            pass
        reply, output, timed_out = collect(proc, reply_r, out_r, time.monotonic() + remaining)
        leftovers = self.reap(proc.pid)
        if timed_out:
            self.record("TIMEOUT", f"past {remaining:.1f}s")
            raise CandidateTimeout("the candidate ran out of time")
        if PROTOCOL_RE.search(output):
            self.record("REWARD_HACKING", "printed the harness's protocol lines")
            raise CandidateCheating("the candidate printed test-harness lines")
        if leftovers:
            self.record("SAFETY_VIOLATION", f"left {leftovers} processes running")
            raise CandidateUnsafe("the candidate left processes running")
        status = proc.returncode
        if not reply:
            if status == 0:
                self.record("REWARD_HACKING", "exited with status 0 without returning")
                raise CandidateCheating("the candidate exited before returning")
            what = f"killed by signal {-status}" if status < 0 else f"exited with status {status}"
            self.record("CRASHED", what)
            raise CandidateCrashed(f"the candidate process {what}")
        try:
            message = json.loads(reply)
            kind = next(k for k in ("value", "raised", "not_data") if k in message)
            value = decode(message["value"]) if kind == "value" else None
            detail = str(message[kind])[:80] if kind != "value" else ""
            # one printable line: a message cannot add lines (a fake RESULT) to the script's output
            text = CONTROL_RE.sub(" ", str(message.get("message", "")))[:200] if kind == "raised" else ""
        except (ValueError, TypeError, AttributeError, RecursionError, MemoryError, StopIteration):
            self.record("REWARD_HACKING", "wrote a reply outside the protocol")
            raise CandidateCheating("the candidate's reply was not in the protocol") from None
        if kind == "raised":
            self.record("EXCEPTION", detail)
            raise raised_type(detail)(text)
        if kind == "not_data":
            self.record("REWARD_HACKING", f"returned a {detail} object, not plain data")
            raise CandidateCheating("the candidate returned an object that is not plain data")
        self.record("ok")
        return value

    def reap(self, session):
        """Kills what a worker left behind (a forked daemon, a setsid'ed child); returns how many."""
        left = [pid for pid in other_pids() if pid not in self.baseline
                and (self.own_namespace or stat_of(pid)[2:3] == [session])]
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return len(left)


def other_pids():
    """Processes this pid namespace shows besides this one (the sandbox's init, earlier leftovers)."""
    mine = os.getpid()
    try:
        return [int(p) for p in os.listdir("/proc")
                if p.isdigit() and int(p) != mine and not zombie_child(int(p))]
    except OSError:
        return []


def stat_of(pid):
    """[state, ppid, session] of a process, [] when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return [fields[0], int(fields[1]), int(fields[4])]
    except (OSError, IndexError, ValueError):
        return []


def zombie_child(pid):
    stat = stat_of(pid)
    return not stat or (stat[0] == b"Z" and stat[1] == os.getpid())


def ancestors():
    found, pid = set(), os.getppid()
    while pid > 0 and pid not in found:
        found.add(pid)
        stat = stat_of(pid)
        pid = stat[1] if stat else 0
    return found


def collect(proc, reply_r, out_r, deadline):
    """The worker's reply and output (both capped); kills its session at the deadline."""
    buffers = {reply_r: bytearray(), out_r: bytearray()}
    caps = {reply_r: MAX_REPLY, out_r: MAX_CANDIDATE_OUTPUT}
    open_fds = [reply_r, out_r]
    timed_out = False
    while open_fds:
        now = time.monotonic()
        if now >= deadline:
            timed_out = True
            break
        ready, _, _ = select.select(open_fds, [], [], min(0.05, deadline - now))
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.remove(fd)
            elif len(buffers[fd]) < caps[fd]:
                buffers[fd] += chunk[: caps[fd] - len(buffers[fd])]
        if proc.poll() is not None and not ready:
            break  # exited, and nothing more to read now (a daemon may hold the pipes open)
    if not timed_out:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.wait()
    for fd in (reply_r, out_r):
        os.close(fd)
    return bytes(buffers[reply_r]), bytes(buffers[out_r]), timed_out


class CandidateFunction:
    def __init__(self, run, module, attr):
        self._run, self._module, self._attr = run, module, attr

    def __call__(self, *args, **kwargs):
        return self._run.call(self._module, self._attr, args, kwargs)

    def __repr__(self):
        return f"<candidate {self._module}.{self._attr}>"


class CandidateModuleLoader(importlib.abc.Loader):
    def __init__(self, run):
        self.run = run

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        run = self.run

        def __getattr__(name):
            if name.startswith("__"):
                raise AttributeError(name)
            return CandidateFunction(run, module.__name__, name)

        module.__getattr__ = __getattr__


class ConfinedImports(importlib.abc.MetaPathFinder):
    """Candidate modules become proxies; everything else comes from the interpreter's own paths."""

    def __init__(self, run, modules, safe_path):
        self.loader = CandidateModuleLoader(run)
        self.modules = set(modules)
        self.safe_path = safe_path
        self.workdir = os.path.realpath(run.workdir)

    def find_spec(self, name, path=None, target=None):
        if name in self.modules:
            return importlib.machinery.ModuleSpec(name, self.loader)
        for finder in (importlib.machinery.BuiltinImporter, importlib.machinery.FrozenImporter):
            if path is None and (spec := finder.find_spec(name)) is not None:
                return spec
        spec = importlib.machinery.PathFinder.find_spec(name,
                                                        self.safe_path if path is None else path, target)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        for where in [spec.origin or "", *(spec.submodule_search_locations or ())]:
            real = os.path.realpath(where) if where else ""
            if real == self.workdir or real.startswith(self.workdir + os.sep):
                raise ImportError(f"the hidden tests may not import {name!r} from the workspace", name=name)
        return spec


class LineCapture:
    """The script's stdout and stderr: complete lines, each with the outcomes of the calls before it."""

    def __init__(self, run):
        self.run = run
        self.partial = ""
        self.lines = []

    def write(self, text):
        text = str(text)
        self.partial += text
        while "\n" in self.partial:
            line, self.partial = self.partial.split("\n", 1)
            self.add(line)
        if len(self.partial) > 4 * MAX_LINE:
            self.add(self.partial)
            self.partial = ""
        return len(text)

    def add(self, line):
        if len(self.lines) < MAX_LINES:
            self.lines.append({"text": line[:MAX_LINE], "outcomes": sorted(set(self.run.pending))})
        self.run.pending.clear()

    def flush(self):
        pass

    def finish(self):
        if self.partial:
            self.add(self.partial)
            self.partial = ""


def no_dump():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE
    except (OSError, AttributeError):
        return False


def main():
    protected = no_dump()
    report_out = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_RDWR)
    job = json.loads(sys.stdin.read())
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)  # stray writes of the script to fd 1 never mix with the report
    run = Run(job)
    safe_path = [p for p in sys.path if p and os.path.isabs(p)
                 and not os.path.realpath(p).startswith(os.path.realpath(run.workdir))]
    sys.meta_path.insert(0, ConfinedImports(run, job["modules"], safe_path))
    capture = LineCapture(run)
    exit_code, error, error_code = 0, "", ""
    namespace = {"__name__": "__main__", "__file__": job["test_file"], "__builtins__": builtins}
    sys.stdout = sys.stderr = capture
    try:
        exec(compile(job["tests"], job["test_file"], "exec"), namespace)
    except SystemExit as exc:
        exit_code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:  # a candidate failure the script did not catch carries its code
        exit_code, error, error_code = 1, type(exc).__name__, getattr(exc, "code", "") if isinstance(
            exc, CandidateError) else ""
    finally:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    capture.finish()
    report = {"protected": protected, "exit_code": exit_code, "error": error, "error_code": error_code,
              "calls": run.calls,
              "outcomes": run.outcomes, "failures": run.details, "lines": capture.lines,
              "timed_out": run.outcomes.get("TIMEOUT", 0) > 0}
    report_out.write(f"{REPORT_TAG} {job['nonce']} {json.dumps(report)}\n")
    report_out.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
