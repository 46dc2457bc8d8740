"""Build vlkv's C++ CPU kernels into torch's extension cache ahead of the tests (``.ci/run`` starts it in
the background while the demo packages install and ruff runs).

A fresh environment compiles each kernel on its first use, ~30 s each on CI's two cores. Inside pytest
that first use is a test: its xdist worker compiles while the other worker's tests that need the same
kernel wait on the build lock. Here each kernel is built by the runtime's own entry point
(``vlkv.plugins.<module>.kernel()``: the same source, flags and build name as a user's first call), in
its own process (one process builds one extension at a time), ``--jobs`` at once. A test that starts
before its kernel is done waits on the same lock and then loads the binary, as it would from a user's
cache. A kernel that fails to build here fails nothing: the tests build it again and report it.

    python .ci/build_kernels.py --jobs 2
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# every module of vlkv.plugins that compiles an extension (``paged_cpu_kernel.load_extension``), the
# kernels the most test files load first (tests/test_ci_build_kernels.py checks the list is complete)
KERNELS = ("paged_cpu_kernel", "skinny_gemm", "layer_glue", "decode_layer", "evict_rows", "weight_pages")
# scripts that compile an extension of their own (tests/plugins/test_bench_decode_layer.py runs this one),
# built by a one-round run of the script itself on its smallest shape
SCRIPTS = {
    "bench_gemm_stream": [
        "scripts/bench_gemm_stream.py",
        "--rows",
        "1",
        "--rounds",
        "1",
        "--ring-mib",
        "4",
        "--shapes",
        "k/v 192x576",
    ],  # fmt: skip
}


def build(name: str) -> tuple[str, int, float, str]:
    """Build ``vlkv.plugins.<name>``'s extension (or run the script ``SCRIPTS[name]``) in a new process:
    ``(name, exit code, seconds, stderr)``."""
    code = f"import sys\nfrom vlkv.plugins import {name}\nsys.exit(0 if {name}.kernel() is not None else 1)"
    cmd = (
        [sys.executable, str(ROOT / SCRIPTS[name][0]), *SCRIPTS[name][1:]]
        if name in SCRIPTS
        else [sys.executable, "-c", code]
    )
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True)
    return name, done.returncode, time.monotonic() - start, done.stderr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2, help="kernels built at once (one process each)")
    args = ap.parse_args()
    failed = 0
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for name, code, secs, err in pool.map(build, [*KERNELS, *SCRIPTS]):
            print(f"build_kernels: {name} {'ok' if code == 0 else 'FAILED'} in {secs:.0f} s", flush=True)
            if code != 0:
                failed += 1
                print(err[-2000:], file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
