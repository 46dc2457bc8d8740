"""``scripts/bench_decode_bound.py --tiny`` end to end: one run measures the bandwidth, prefills once,
times vlkv's full cache, the policies and both transformers caches, and writes JSON + markdown."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_decode_bound.py"


def test_tiny_run_reports_every_configuration_against_the_bound_and_the_peers(tmp_path):
    out, md = tmp_path / "b.json", tmp_path / "b.md"
    cmd = [
        sys.executable, str(SCRIPT), "--tiny", "--threads", "1", "--policies", "h2o", "snapkv",
        "--budgets", "0.5", "0.2", "--dense", "--kernel", "--json", str(out), "--md", str(md),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    res = json.loads(out.read_text())
    rows = {r["config"]: r for r in res["rows"]}
    want = [
        "full",
        "full-dense",
        "full-kernel",
        "static",
        "dynamic",
        "h2o@0.5",
        "h2o@0.2",
        "snapkv@0.5",
        "snapkv@0.2",
    ]
    assert sorted(rows) == sorted(want)
    assert res["runtime_lines"] > 1000
    assert res["bandwidth_gb_s"] > 0 and res["weight_bytes"] > 0
    # the peers decode from vlkv's prefilled K/V: their greedy tokens equal vlkv's full cache
    assert res["peers_same_tokens"] == {"static": True, "dynamic": True}
    assert res["fastest_peer"] in ("static", "dynamic")
    for r in rows.values():
        assert r["step_ms"] > 0 and r["ops_per_step"] > 0
        assert abs(r["of_bound"] - r["bound_ms"] / r["step_ms"]) < 1e-9
        # every round's step is kept, and the reported step is their median
        assert len(r["step_ms_rounds"]) == res["repeats"]
        assert abs(statistics.median(r["step_ms_rounds"]) - r["step_ms"]) < 1e-9
        assert r["bytes_per_step"] >= res["weight_bytes"] + r["kv_bytes"]
    # a compressed cache attends fewer bytes than the full one
    assert rows["snapkv@0.2"]["kv_bytes"] < rows["snapkv@0.5"]["kv_bytes"] < rows["full"]["kv_bytes"]
    # the dense read (before paged reads) copies every entry it attends into scratch, the paged read
    # of these short requests gathers them together once: the same bytes, but never more
    assert rows["full-dense"]["gathered_bytes"] >= rows["full"]["gathered_bytes"] > 0
    assert rows["h2o@0.5"]["gathered_bytes"] > 0  # its statistics read (paged_probs) gathers too
    assert "| full |" in md.read_text() and "GB/s" in md.read_text()


def test_bad_budget_is_one_line():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--budgets", "1.5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--budgets must be in (0, 1)" in done.stderr


def test_per_head_policies_compress_by_replay_and_read_through_the_kernel(tmp_path):
    """kvzip is measured compressed (its replay scores reach the bench), and ``--kernel-policies`` adds
    each policy read by the fused kernel's table rows: nothing gathered, the attention time reported."""
    out = tmp_path / "h.json"
    cmd = [
        sys.executable, str(SCRIPT), "--tiny", "--threads", "1", "--policies", "kvzip", "snapkv",
        "--budgets", "0.5", "--peers", "--kernel", "--kernel-policies", "--buffer-mib", "16", "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    want = ["full", "full-kernel", "kvzip@0.5", "snapkv@0.5", "kvzip@0.5+kernel", "snapkv@0.5+kernel"]
    assert sorted(rows) == sorted(want)
    assert rows["kvzip@0.5"]["kv_bytes"] < rows["full"]["kv_bytes"]  # compressed: the replay ran
    for name in ("kvzip@0.5", "snapkv@0.5"):
        assert rows[name]["gathered_bytes"] > 0  # the matmul path gathers per-head tables
        assert rows[f"{name}+kernel"]["gathered_bytes"] == 0  # the kernel reads them in place
        assert rows[f"{name}+kernel"]["kv_bytes"] == rows[name]["kv_bytes"]
    for r in rows.values():
        assert r["attn_ms"] > 0 and r["speed_vs_full"] > 0


def test_statistics_steps_by_the_kernel_and_by_the_halves(tmp_path):
    """``--stats-halves`` adds each policy with its statistics steps read by ``paged_probs``' two halves
    beside ``+kernel`` (one read of each head's table row); ``--skip-matmul`` drops the reads without
    the kernel. The kernel's statistics steps gather nothing, the halves gather H2O's per-head tables,
    both decode the same tokens and their attention (probabilities included) is timed."""
    out = tmp_path / "s.json"
    cmd = [
        sys.executable, str(SCRIPT), "--tiny", "--threads", "1", "--policies", "h2o", "--budgets", "0.5",
        "--peers", "--kernel", "--kernel-policies", "--stats-halves", "--skip-matmul", "--buffer-mib", "16",
        "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    res = json.loads(out.read_text())
    rows = {r["config"]: r for r in res["rows"]}
    assert sorted(rows) == sorted(["full-kernel", "h2o@0.5+kernel", "h2o@0.5+halves"])
    assert res["peers_same_tokens"] == {"h2o@0.5+kernel=+halves": True}
    assert rows["h2o@0.5+kernel"]["gathered_bytes"] == 0 < rows["h2o@0.5+halves"]["gathered_bytes"]
    assert rows["h2o@0.5+kernel"]["kv_bytes"] == rows["h2o@0.5+halves"]["kv_bytes"]
    for r in rows.values():
        assert r["attn_ms"] > 0 and r["speed_vs_full"] > 0


def test_skip_matmul_needs_the_kernel_configuration():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--skip-matmul"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--skip-matmul needs --kernel" in done.stderr


# Every before switch of the fused configurations in ONE run (each flag adds its own before rows, the
# script lists and runs each configuration's before rows right after it): a --tiny run's start-up,
# bandwidth, models and prefill (~15-25 s on a loaded 2-core machine) were paid once per flag before
BEFORES = {
    "--torch-gemm": "+torchgemm",
    "--split-append": "+split",
    "--torch-evict": "+torchevict",
    "--gemm-s7": "+gemms7",
    "--gemm-s8": "+gemms8",
    "--kv-4k": "+kv4k",
}
BASES = ["full-kernel", "h2o@0.5+kernel", "snapkv@0.5+kernel"]
EVICTING = ["h2o@0.5+kernel"]  # snapkv evicts nothing while decoding: no +torchevict row


@pytest.fixture(scope="module")
def befores(tmp_path_factory):
    return _tiny_before_after(
        tmp_path_factory.mktemp("befores"), "--policies", "h2o", "snapkv", "--budgets", "0.5", *BEFORES
    )


def _with(suffix: str) -> list[str]:
    """The before rows ``suffix`` adds: one per fused configuration (``+torchevict``: the evicting ones)."""
    return [b + suffix for b in (EVICTING if suffix == "+torchevict" else BASES)]


def test_every_before_row_runs_right_after_its_configuration(befores):
    """Each before row runs (and is listed) right after its configuration, the befores in the flags'
    order: a configuration and its befores share their moment; each decodes its configuration's tokens."""
    res, rows, _ = befores
    want = [c for b in BASES for c in [b, *(b + s for s in BEFORES.values() if b + s in _with(s))]]
    assert [r["config"] for r in res["rows"]] == want
    assert res["peers_same_tokens"] == {c: True for c in want if c not in BASES}


def test_torch_gemm_rows_are_the_c_plus_plus_gemm_s_before_and_after(befores):
    """``--torch-gemm`` adds each fused configuration again with the decode GEMMs by torch
    (``VLKV_CPU_GEMM=0``): the same greedy tokens, both timed in the same rounds."""
    res, rows, _ = befores
    assert [c for c in rows if c.endswith("+torchgemm")] == _with("+torchgemm")
    assert res["cpp_gemm"] is True
    assert all(res["peers_same_tokens"][c] is True for c in _with("+torchgemm"))
    for name in BASES + _with("+torchgemm"):
        assert len(rows[name]["step_ms_rounds"]) == res["repeats"] and rows[name]["speed_vs_full"] > 0
    # the rows ran the GEMMs they name: the C++ GEMM in the plain rows, torch's in +torchgemm
    for name in BASES:
        assert rows[name]["cpp_gemm_calls_per_step"] > 0, name
        assert rows[name + "+torchgemm"]["cpp_gemm_calls_per_step"] == 0, name


def test_split_append_rows_are_the_fused_append_s_before_and_after(befores):
    """``--split-append`` adds each fused configuration again with the Python append and a separate
    paged read (``VLKV_CPU_APPEND=0``): the same greedy tokens, both timed in the same rounds, the
    fused rows' paired ratio against them reported, their attention time counted (the fused call)."""
    res, rows, md = befores
    assert [c for c in rows if c.endswith("+split")] == _with("+split")
    assert res["fused_append"] is True
    assert all(res["peers_same_tokens"][c] is True for c in _with("+split"))
    for name in BASES:
        assert rows[name]["speed_vs_split"] > 0 and rows[name]["attn_ms"] > 0
        assert rows[name]["ops_per_step"] < rows[name + "+split"]["ops_per_step"]  # the ops it removes
        assert "speed_vs_split" not in rows[name + "+split"]
    assert "vs +split" in md


def test_torch_evict_rows_are_the_one_call_eviction_s_before_and_after(befores):
    """``--torch-evict`` adds each policy's kernel configuration again with its decode eviction by
    torch ops per layer (``VLKV_CPU_EVICT=0``): the same greedy tokens, timed in the same rounds, the
    paired ratio reported on the one-call rows."""
    res, rows, md = befores
    # snapkv evicts nothing while decoding: no before row
    assert [c for c in rows if c.endswith("+torchevict")] == ["h2o@0.5+kernel+torchevict"]
    assert res["fused_evict"] is True
    assert res["peers_same_tokens"]["h2o@0.5+kernel+torchevict"] is True
    assert rows["h2o@0.5+kernel"]["speed_vs_torchevict"] > 0
    assert "speed_vs_torchevict" not in rows["snapkv@0.5+kernel"]
    # the same GEMMs (the C++ few-row GEMM) in both: only the eviction differs
    assert (
        rows["h2o@0.5+kernel+torchevict"]["cpp_gemm_calls_per_step"]
        == rows["h2o@0.5+kernel"]["cpp_gemm_calls_per_step"]
        > 0
    )
    assert "speed_vs_torchevict" not in rows["h2o@0.5+kernel+torchevict"]
    assert "vs +torchevict" in md


def _tiny_before_after(tmp_path, *flags: str) -> tuple[dict, dict, str]:
    """A ``--tiny`` kernel run with ``flags`` (its before/after switch): the json, its rows by config, the md."""
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    cmd = [
        sys.executable, str(SCRIPT), "--tiny", "--threads", "1", *flags, "--peers", "--kernel",
        "--kernel-policies", "--skip-matmul", "--buffer-mib", "16", "--json", str(out), "--md", str(md),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    res = json.loads(out.read_text())
    return res, {r["config"]: r for r in res["rows"]}, md.read_text()


@pytest.mark.parametrize("form", ["s7", "s8"])
def test_gemm_form_rows_are_the_gemm_form_s_before_and_after(befores, form):
    """``--gemm-s7`` / ``--gemm-s8`` add each fused configuration again with the few-row GEMMs in their
    session-7 / session-8 form (both extensions' flag): the same tokens (the forms are bit-equal), the
    same C++ GEMM calls, timed in the same rounds, the paired ratio on the current rows."""
    sfx = f"+gemm{form}"
    res, rows, md = befores
    assert [c for c in rows if c.endswith(sfx)] == _with(sfx)
    assert all(res["peers_same_tokens"][c] is True for c in _with(sfx))
    for name in BASES:
        assert rows[name][f"speed_vs_gemm{form}"] > 0 and f"speed_vs_gemm{form}" not in rows[name + sfx]
        assert rows[name + sfx]["cpp_gemm_calls_per_step"] == rows[name]["cpp_gemm_calls_per_step"]
    assert f"vs {sfx}" in md


def test_heap_default_rows_and_the_image_first_layout(tmp_path):
    """``--heap-default`` adds each fused configuration again with glibc's heap thresholds (the before of
    ``paged_cpu_heap``): the same tokens (a memory policy, no value changes), paired ratios on the
    current rows. ``--layout image-first`` puts the document after the image, where A-VL's text budget
    covers it: its compressed step attends far fewer K/V bytes than the full cache (document-first, A-VL
    keeps the document whole as its system region)."""
    res, rows, md = _tiny_before_after(
        tmp_path, "--policies", "avl", "--budgets", "0.5", "--heap-default", "--layout", "image-first"
    )
    want = ["full-kernel", "avl@0.5+kernel", "full-kernel+heapdefault", "avl@0.5+kernel+heapdefault"]
    assert sorted(rows) == sorted(want)
    assert res["layout"] == "image-first" and "image-first" in md
    assert res["peers_same_tokens"] == {"full-kernel+heapdefault": True, "avl@0.5+kernel+heapdefault": True}
    for name in ("full-kernel", "avl@0.5+kernel"):
        assert (
            rows[name]["speed_vs_heapdefault"] > 0
            and "speed_vs_heapdefault" not in rows[name + "+heapdefault"]
        )
    assert rows["avl@0.5+kernel"]["kv_bytes"] < 0.8 * rows["full-kernel"]["kv_bytes"]
    assert "vs +heapdefault" in md


def test_kv_4k_rows_are_the_pool_s_huge_pages_before_and_after(befores):
    """``--kv-4k`` adds each configuration again with its KV pool in 4 KiB pages (``VLKV_KV_HUGE_PAGES=0``):
    the same tokens (only the memory differs), the step and the attention paired per round, and each row
    says how much of its pool the kernel held in huge pages (the 4 KiB rows none)."""
    from vlkv.runtime.kv import pool_memory

    res, rows, md = befores
    assert [c for c in rows if c.endswith("+kv4k")] == _with("+kv4k")
    assert all(res["peers_same_tokens"][c] is True for c in _with("+kv4k"))
    for name in BASES:
        assert rows[name]["speed_vs_kv4k"] > 0 and rows[name]["attn_vs_kv4k"] > 0
        assert "speed_vs_kv4k" not in rows[name + "+kv4k"] and rows[name + "+kv4k"]["attn_vs_kv4k"] is None
        assert 0.0 <= rows[name]["kv_huge_share"] <= 1.0
        if pool_memory.thp_mode() == "madvise":  # memory not advised gets no huge page in this mode
            assert rows[name + "+kv4k"]["kv_huge_share"] == 0.0
    assert "vs +kv4k" in md and "KV in huge pages" in md
