"""A small seccomp deny-list for sandboxed programs, as the classic-BPF bytes bwrap's --seccomp reads.

Without capabilities a sandboxed program already cannot mount, load modules or change uids. What
it can still reach are kernel interfaces that are unprivileged yet large, and historically rich in
exploitable bugs; those are refused here, as container runtimes' default profiles do:
- user namespaces (clone/unshare with CLONE_NEWUSER): inside one a process is "root" again for
  mounts, netfilter, etc., a well-trodden path to kernel exploits;
- keyrings, eBPF, perf events, userfaultfd and io_uring.
clone3 answers ENOSYS so that libc falls back to clone, whose flags a filter can inspect (clone3
passes them in memory). Calls from another ABI (i386, x32) are refused too, since the filter's
syscall numbers would not apply to them. Everything else is allowed.
"""

from __future__ import annotations

import errno
import platform
import struct

# BPF opcodes (linux/filter.h) and seccomp constants (linux/seccomp.h, linux/audit.h).
_LD_ABS_W = 0x20
_JEQ = 0x15
_JGE = 0x35
_JSET = 0x45
_RET = 0x06
_ALLOW = 0x7FFF0000
_KILL_PROCESS = 0x80000000
_ERRNO = 0x00050000
_OFF_NR, _OFF_ARCH, _OFF_ARG0 = 0, 4, 16  # struct seccomp_data; args are little-endian u64
_X32_BIT = 0x40000000
CLONE_NEWUSER = 0x10000000

_DENIED: tuple[str, ...] = ("add_key", "request_key", "keyctl", "bpf", "perf_event_open", "userfaultfd")
_DENIED += ("io_uring_setup", "io_uring_enter", "io_uring_register")

# machine -> (AUDIT_ARCH_*, syscall numbers)
_ARCHES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (
        0xC000003E,
        {
            "clone": 56,
            "add_key": 248,
            "request_key": 249,
            "keyctl": 250,
            "unshare": 272,
            "perf_event_open": 298,
            "bpf": 321,
            "userfaultfd": 323,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "clone3": 435,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {
            "unshare": 97,
            "add_key": 217,
            "request_key": 218,
            "keyctl": 219,
            "clone": 220,
            "perf_event_open": 241,
            "bpf": 280,
            "userfaultfd": 282,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "clone3": 435,
        },
    ),
}


# A filter that allows everything: valid on any architecture. Used where no syscall table is known,
# because the driver hands every exec its filter through a pipe that also gates the exec's start.
ALLOW_ALL = struct.pack("<HBBI", _RET, 0, 0, _ALLOW)


def sandbox_filter(machine: str | None = None) -> bytes | None:
    """The filter for this machine's architecture, or None where no syscall table is known."""
    arch = _ARCHES.get(machine or platform.machine())
    if arch is None:
        return None
    audit_arch, nr = arch
    prog = _Program()
    prog.load(_OFF_ARCH)
    prog.jump(_JEQ, audit_arch, if_true="native", if_false="foreign")
    prog.label("native")
    prog.load(_OFF_NR)
    if audit_arch == _ARCHES["x86_64"][0]:
        prog.jump(_JGE, _X32_BIT, if_true="enosys", if_false="nr")
    prog.label("nr")
    for name in _DENIED:
        prog.jump(_JEQ, nr[name], if_true="eperm")
    prog.jump(_JEQ, nr["clone3"], if_true="enosys")
    prog.jump(_JEQ, nr["clone"], if_true="flags")
    prog.jump(_JEQ, nr["unshare"], if_true="flags")
    prog.ret(_ALLOW)
    prog.label("flags")  # clone's and unshare's flags are both the first argument
    prog.load(_OFF_ARG0)
    prog.jump(_JSET, CLONE_NEWUSER, if_true="eperm")
    prog.ret(_ALLOW)
    prog.label("eperm")
    prog.ret(_ERRNO | errno.EPERM)
    prog.label("enosys")
    prog.ret(_ERRNO | errno.ENOSYS)
    prog.label("foreign")
    prog.ret(_KILL_PROCESS)
    return prog.assemble()


class _Program:
    """Just enough of a BPF assembler: loads, conditional jumps to labels, returns."""

    def __init__(self) -> None:
        self._code: list[tuple[int, str | None, str | None, int]] = []
        self._labels: dict[str, int] = {}

    def load(self, offset: int) -> None:
        self._code.append((_LD_ABS_W, None, None, offset))

    def jump(self, op: int, k: int, *, if_true: str, if_false: str | None = None) -> None:
        self._code.append((op, if_true, if_false, k))

    def ret(self, value: int) -> None:
        self._code.append((_RET, None, None, value))

    def label(self, name: str) -> None:
        self._labels[name] = len(self._code)

    def assemble(self) -> bytes:
        out = bytearray()
        for pc, (op, jt, jf, k) in enumerate(self._code):
            out += struct.pack("<HBBI", op, self._offset(pc, jt), self._offset(pc, jf), k)
        return bytes(out)

    def _offset(self, pc: int, label: str | None) -> int:
        if label is None:
            return 0  # fall through to the next instruction
        offset = self._labels[label] - pc - 1
        if not 0 <= offset <= 255:
            raise ValueError(f"BPF jump to {label!r} out of range ({offset})")
        return offset
