"""``paged_cpu_heap``: glibc's thresholds set to keep freed memory, the switch, the engine-start call,
and the effect it exists for (a step's freed probabilities reused, not faulted in again)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from vlkv.plugins import paged_cpu, paged_cpu_heap, skinny_gemm


class FakeLibc:
    def __init__(self, ok: int = 1):
        self.calls, self.ok = [], ok

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.ok


@pytest.fixture
def fake(monkeypatch):
    lib = FakeLibc()
    monkeypatch.setattr(paged_cpu_heap, "_LIBC", [lib])
    return lib


def test_keep_sets_both_thresholds_and_default_restores_glibc_s(fake):
    assert paged_cpu_heap.set_heap(True)
    assert fake.calls == [(-1, paged_cpu_heap.TRIM), (-3, paged_cpu_heap.MMAP_MAX)]
    fake.calls.clear()
    assert paged_cpu_heap.set_heap(False)
    assert fake.calls == [(-1, 128 * 1024), (-3, 128 * 1024)]
    # glibc refuses a mmap threshold above 32 MiB on 64-bit: the constant stays within it
    assert paged_cpu_heap.MMAP_MAX <= 32 * 2**20


def test_a_refused_setting_is_reported(fake):
    fake.ok = 0
    assert not paged_cpu_heap.set_heap(True)


def test_switch_off_and_no_glibc_leave_the_heap_alone(fake, monkeypatch):
    monkeypatch.setattr(paged_cpu_heap, "KEEP_FREED", False)
    assert not paged_cpu_heap.keep_freed()
    assert fake.calls == []
    monkeypatch.setattr(paged_cpu_heap, "KEEP_FREED", True)
    monkeypatch.setattr(paged_cpu_heap, "_LIBC", [None])
    assert not paged_cpu_heap.keep_freed() and not paged_cpu_heap.set_heap(False)


def test_warm_up_keeps_freed_memory_on_a_cpu_only(monkeypatch):
    calls = []
    monkeypatch.setattr(paged_cpu_heap, "keep_freed", lambda: calls.append(1) or True)
    monkeypatch.setattr(skinny_gemm, "warm_up", lambda device, dtype: False)  # no builds here
    monkeypatch.setattr(paged_cpu, "FUSED_KERNEL", False)
    assert not paged_cpu.warm_up("cpu", torch.float32)
    assert calls == [1]
    paged_cpu.warm_up("meta", torch.float32)
    assert calls == [1]


# Run in a fresh interpreter: in a long process (the whole suite) the heap's free chunks left by earlier
# tests serve these blocks from memory already faulted in, whatever the thresholds say now.
_FAULTS = """
import resource, sys
import torch
from vlkv.plugins import paged_cpu_heap
assert paged_cpu_heap.set_heap(sys.argv[1] == "keep")
layers, nbytes = 30, 1_200_000
for _ in range(3):  # the last of three steps that each hold, write and free a statistics step's blocks
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [torch.empty(nbytes // 4) for _ in range(layers)]
    for b in blocks:
        b.fill_(1.0)
    del blocks
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults_of_a_step(mode: str) -> int:
    """Minor page faults of the third of three "steps" that each hold 30 blocks of 1.2 MB alive, write
    them, then free them all (a statistics step's probabilities), in a new process with the heap
    ``mode`` ("keep" or "default"). The third: in a new process the heap reaches its working size only
    over the first two (measured: keep 8,817 / 3,809 / 0 faults, default 8,790 every step)."""
    proc = subprocess.run(
        [sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split()[-1])


def test_freed_blocks_are_reused_not_faulted_in_again():
    if paged_cpu_heap._libc() is None:  # not glibc: the setting is a no-op, nothing to compare
        assert not paged_cpu_heap.set_heap(True)
        return
    given_back, kept = _faults_of_a_step("default"), _faults_of_a_step("keep")
    pages = 30 * 1_200_000 // 4096
    assert given_back > pages // 2  # each block mapped afresh: its pages faulted in on the write
    assert kept < pages // 10
