"""Every Triton kernel vlkv launches on a GPU compiles for sm_90 (Hopper: the H100/H200 the GPU checks run
on) on this CPU machine: Triton's whole compiler, which the interpreter-run tests never reach
(``plugins/triton_target.py``; run 7's low-rank compile error passed every CPU test). The launches and
their variants are ``sm90_cases``'. A child process per Triton install: the kernels must be imported with
the interpreter off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.plugins.sm90_cases import cases

pytest.importorskip("triton", reason="the triton extra is part of vlkv[dev]")

ROOT = Path(__file__).resolve().parents[2]


def compile_all() -> dict[str, dict]:
    """Per case (``sm90_cases``: launcher/variant): ``{"compiled": kernel names, "error": None or the
    compile error}``; a failing case does not stop the others. Run with ``TRITON_INTERPRET=0``."""
    from vlkv.plugins.triton_target import compile_only

    out = {}
    for case in cases():
        got, error = None, None
        with compile_only(arch=90) as compiled:
            try:
                got = case.launch()
            except Exception as exc:  # noqa: BLE001 - each case's error is reported, the rest still compile
                error = f"{type(exc).__name__}: {exc}"[-3000:]
        # an AOT case compiles through ``triton.compile`` (no launch) and returns its kernel's name
        names = [*compiled, *([got] if isinstance(got, str) else [])]
        out[case.name] = {"compiled": names, "error": error}
    return out


# another Triton to compile with besides the installed one: the GPU machines' (3.6; .ci/run installs it
# beside the venv), whose passes differ (run 7's error is 3.6's; 3.9 compiled the same kernel)
ALT_ENV = "VLKV_TRITON_ALT"


def tritons() -> list[str]:
    """The Triton installs to compile with: "" (the installed one), then ``$VLKV_TRITON_ALT``'s folders."""
    return ["", *filter(None, os.environ.get(ALT_ENV, "").split(os.pathsep))]


@pytest.mark.parametrize("alt", tritons(), ids=lambda a: "installed" if not a else Path(a).name)
def test_every_gpu_kernel_compiles_for_sm90(alt, tmp_path):
    path = os.pathsep.join(filter(None, [alt, str(ROOT)]))
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=path)
    code = "import json; from tests.plugins.test_triton_sm90 import compile_all; print(json.dumps(compile_all()))"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    table = cases()
    assert list(got) == [c.name for c in table]
    errors = {name: r["error"] for name, r in got.items() if r["error"]}
    assert not errors, "\n\n".join(f"{name}: {e}" for name, e in errors.items())
    for case in table:  # each launch compiled the kernels it stands for
        missing = set(case.kernels) - set(got[case.name]["compiled"])
        assert not missing, (case.name, got[case.name]["compiled"])
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
