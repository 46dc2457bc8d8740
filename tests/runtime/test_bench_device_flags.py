"""Every benchmark script takes ``--device`` and ``--dtype bf16``; a device missing here is one line, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
NAMES = (
    "bench_attnpack",
    "bench_decode",
    "bench_image_qa",
    "bench_kernels",
    "bench_link",
    "bench_ort",
    "bench_overhead",
    "bench_policies",
    "bench_prefill_stats",
    "bench_rope_read",
    "bench_runtime",
    "bench_serve",
    "bench_store",
)
SCRIPTS = [ROOT / "scripts" / f"{name}.py" for name in NAMES]

# One interpreter imports what every script imports (torch, transformers, vlkv: most of a script's start,
# ~5 s each on a quiet 2-core machine) once, then forks a child per script that runs it as ``__main__``
# with the script's folder first on its path, as ``python script.py`` would: each child's stdout / stderr
# (file descriptors, so C-level writes too) and exit status are the script's own, and nothing a script
# does reaches the next one (each runs in its own forked process). The parent must run no torch op before
# forking: a child of a process that entered an OpenMP parallel region hangs in its own first one (libgomp
# is not fork-safe). Each child also takes one thread (what DataLoader workers do against that) and an
# alarm, so a hang is a failed script (killed by SIGALRM), never a stalled suite.
_RUNNER = r"""
import json, os, runpy, signal, sys, traceback
import torch, transformers, vlkv.runtime.engine  # noqa: F401  (the shared imports, paid once)
out = {}
for script in sys.argv[1:]:
    r_out, w_out = os.pipe()
    r_err, w_err = os.pipe()
    pid = os.fork()
    if pid == 0:
        torch.set_num_threads(1)
        signal.alarm(120)
        os.close(r_out), os.close(r_err)
        os.dup2(w_out, 1), os.dup2(w_err, 2)
        sys.argv = [script, "--device", "cuda", "--dtype", "bf16"]
        sys.path.insert(0, os.path.dirname(script))
        code = 0
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    os.close(w_out), os.close(w_err)
    with os.fdopen(r_out) as fo, os.fdopen(r_err) as fe:
        import threading
        err = []
        t = threading.Thread(target=lambda: err.append(fe.read()))
        t.start()
        stdout = fo.read()
        t.join()
    _, status = os.waitpid(pid, 0)
    out[script] = {"returncode": os.waitstatus_to_exitcode(status), "stdout": stdout, "stderr": err[0]}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def cuda_runs() -> dict[str, dict]:
    """Per script path: its ``--device cuda --dtype bf16`` run's return code, stdout and stderr."""
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, *map(str, SCRIPTS)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_listed_scripts_exist():
    assert all(s.is_file() for s in SCRIPTS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: --device cuda is valid here")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_cuda_without_a_gpu_is_one_line(script, cuda_runs):
    done = cuda_runs[str(script)]
    out = (done["stdout"] + done["stderr"]).strip().splitlines()
    assert done["returncode"] == 2, done["stdout"] + done["stderr"]
    assert "Traceback" not in done["stderr"]
    assert (
        "cuda" in out[-1].lower()
        and len([line for line in out if "error" in line.lower() or "cuda" in line.lower()]) == 1
    )
