"""The seccomp filter assembles for the architectures it knows and says so for the others."""

from __future__ import annotations

import struct

import pytest

from rlfleet.sandbox.seccomp import sandbox_filter


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_filter_assembles_into_well_formed_bpf(machine):
    prog = sandbox_filter(machine)
    assert prog is not None and len(prog) % 8 == 0
    instructions = [struct.unpack("<HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    for pc, (op, jt, jf, _k) in enumerate(instructions):
        if op & 0x07 == 0x05:  # BPF_JMP: both branches land inside the program
            assert pc + 1 + max(jt, jf) < len(instructions)
    assert instructions[-1][0] == 0x06  # ends in a return


def test_an_unknown_architecture_gets_no_filter():
    assert sandbox_filter("riscv64") is None
