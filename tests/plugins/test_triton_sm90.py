"""The paged kernels compile for sm_90 (Hopper: the H100/H200 the GPU checks run on) on this CPU machine:
Triton's whole compiler, which the interpreter-run tests never reach (``plugins/triton_target.py``; run 7's
low-rank compile error passed every CPU test). A child process: the kernels must be imported with the
interpreter off."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the triton extra is part of vlkv[dev]")

ROOT = Path(__file__).resolve().parents[2]
FORMS = ("plain", "rope-1d", "mrope")


def compile_all() -> dict[str, list[str]]:
    """Per launcher and rotary form (bf16, the GPU runs' dtype), the kernels its launches compiled; low-rank
    factors in every form, path (b) too. Run with ``TRITON_INTERPRET=0``."""
    from tests.plugins.paged_cases import CASES
    from tests.plugins.test_triton_paged_lowrank import CASES as LOWRANK_CASES
    from tests.plugins.test_triton_paged_lowrank import rope_args, with_factors
    from vlkv.plugins import triton_paged_lowrank as tpl
    from vlkv.plugins.triton_paged_attention import paged_attention_triton
    from vlkv.plugins.triton_paged_probs import paged_probs_triton
    from vlkv.plugins.triton_target import compile_only

    dtype, out = torch.bfloat16, {}
    for form in FORMS:
        g = torch.Generator().manual_seed(5)
        args = CASES[1].make(dtype)
        rope = {} if form == "plain" else rope_args(args, None, form, g, dtype)[1]
        low = LOWRANK_CASES[0].make(dtype)
        factors = with_factors(low, g, dtype)
        low_rope = rope_args(low, factors, "post" if form == "plain" else form, g, dtype)[1]
        if form == "plain":  # path (b): post-RoPE factors of request 1, pre-RoPE (unrotated) of the rest
            factors = dataclasses.replace(factors, post_rope=torch.tensor([False, True]))
        one = {k: v for k, v in args.items() if k != "q"} | {"q": args["q"][:, :, :1]}  # probs: one row
        calls = {
            "paged_attention": (paged_attention_triton, args | rope),
            "paged_probs": (paged_probs_triton, one | rope),
            "paged_lowrank": (tpl.paged_lowrank_triton, low | low_rope | {"factors": factors}),
            "paged_lowrank_probs": (tpl.paged_lowrank_probs_triton, low | low_rope | {"factors": factors}),
        }
        for name, (launcher, kw) in calls.items():
            with compile_only(arch=90) as compiled:
                launcher(**kw)
            out[f"{name}/{form}"] = compiled
    return out


# another Triton to compile with besides the installed one: the GPU machines' (3.6; .ci/run installs it
# beside the venv), whose passes differ (run 7's error is 3.6's; 3.9 compiled the same kernel)
ALT_ENV = "VLKV_TRITON_ALT"


def tritons() -> list[str]:
    """The Triton installs to compile with: "" (the installed one), then ``$VLKV_TRITON_ALT``'s folders."""
    return ["", *filter(None, os.environ.get(ALT_ENV, "").split(os.pathsep))]


@pytest.mark.parametrize("alt", tritons(), ids=lambda a: "installed" if not a else Path(a).name)
def test_the_paged_kernels_compile_for_sm90(alt, tmp_path):
    path = os.pathsep.join(filter(None, [alt, str(ROOT)]))
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=path)
    code = "import json; from tests.plugins.test_triton_sm90 import compile_all; print(json.dumps(compile_all()))"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    launchers = ("paged_attention", "paged_probs", "paged_lowrank", "paged_lowrank_probs")
    assert set(got) == {f"{n}/{f}" for n in launchers for f in FORMS}
    for name, kernels in got.items():  # each launcher compiled its main kernel in every form
        main = "paged_lowrank_kernel" if "lowrank" in name else name.split("/")[0] + "_kernel"
        assert main in kernels, (name, kernels)
    # a cubin was written for each compiled variant: Triton's pipeline ran to its end (ptxas included)
    assert list((tmp_path / "cache").rglob("*.cubin")), "no cubin in Triton's cache"


def test_compile_only_refuses_the_interpreter_and_a_compile_error_propagates(tmp_path, monkeypatch):
    from vlkv.plugins.triton_target import compile_only

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=0"), compile_only():
        pass
    # a kernel Triton's front end rejects (arange over 3: not a power of 2): the error reaches the caller
    code = """
import torch, triton, triton.language as tl
from vlkv.plugins.triton_target import compile_only

@triton.jit
def bad(x_ptr):
    tl.store(x_ptr + tl.arange(0, 3), 1.0)

try:
    with compile_only() as compiled:
        bad[(1,)](torch.zeros(4))
except Exception as exc:
    print("raised", type(exc).__name__, compiled)
else:
    print("compiled", compiled)
"""
    env = dict(
        os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT)
    )
    script = tmp_path / "bad_kernel.py"  # a file: Triton reads a kernel's source
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.startswith("raised") and proc.stdout.strip().endswith("[]"), (
        proc.stdout + proc.stderr[-2000:]
    )
