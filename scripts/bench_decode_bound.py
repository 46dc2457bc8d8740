"""Decode steps against the machine's memory bandwidth and against transformers, in one run.

    python scripts/bench_decode_bound.py --model smollm2-llava --tokens 8192 --batch 4 --threads 2 \\
        --json decode-bound.json --md decode-bound.md
    python scripts/bench_decode_bound.py --tiny --json t.json   # seconds: tiny-llava, for the tests

One run: (1) the read bandwidth, a STREAM-like ``sum`` over a buffer far larger than the caches (best of
7, before and after the timed rounds; the bound takes the better); (2) one prompt (document + image +
question, about ``--tokens`` tokens) prefilled ONCE as a batch of one, with every policy's prefill
statistics in the same pass, then repeated ``--batch`` times into each configuration's cache (the rows
are identical, so the copy equals a batch prefill at a quarter of the cost); (3) per repeat, in a
rotating order, ``--steps`` timed greedy decode steps of: vlkv's full cache, each ``--policies`` at each
``--budgets`` (after its prefill edits), with ``--dense`` the full cache read as before paged reads (the
before/after of one run), with ``--kernel`` the full cache and, with ``--kernel-policies``, each policy
configuration again with the fused C++ CPU decode read (``VLKV_CPU_KERNEL=1``: per-head tables read
through their own table rows, ``<config>+kernel``), with ``--stats-halves`` each policy configuration
with the fused read but its statistics steps read by ``paged_probs``' two halves (per-head tables
gathered, K then V: the statistics read before the kernel wrote probabilities, ``<config>+halves``;
``--skip-matmul`` drops the configurations read without the kernel), with ``--torch-gemm`` each fused
configuration again with the decode layers' GEMMs by torch (``VLKV_CPU_GEMM=0``: ``(W @ xᵀ)ᵀ`` instead of
the C++ few-row GEMM of ``vlkv/plugins/skinny_gemm.py``, ``<config>+torchgemm``; the GEMM's before/after
in one run), with ``--split-append`` each fused configuration again with each decode layer's cache append
in Python and its paged read a separate call (``VLKV_CPU_APPEND=0``: the path before
``vlkv/plugins/paged_append.py`` wrote the new entries and read the tables in one C++ call,
``<config>+split``; its before/after in one run), with ``--torch-evict`` each policy's kernel configuration
again with its decode eviction as it was before session 7 (each layer's gap closed by torch ops,
``VLKV_CPU_EVICT=0``, and the kept columns by an int64 + bool sum: ``<config>+kernel+torchevict``), with
``--gemm-s7`` each fused configuration again with the few-row GEMMs in their session-7 form (4 weight rows
per block, the next block prefetched; bit-equal: ``<config>+gemms7``), with ``--gemm-s8`` in their
session-8 form (2 weight rows per block at 3-8 rows, lines 8 KiB ahead into L1; bit-equal:
``<config>+gemms8``), with ``--kv-4k`` each vlkv configuration with its KV pool in 4 KiB pages
(``VLKV_KV_HUGE_PAGES=0``, bit-equal: ``<config>+kv4k``, see ``pool_pages.py``), and transformers' ``generate`` on
the same weights with a ``static`` and a ``DynamicCache`` holding the same prefilled K/V (built from
vlkv's, so no transformers prefill either).

Per configuration: step ms (median over repeats of the mean step), the bound ``(W + KV) / bandwidth``
with ``W`` the weight bytes a step reads (decoder layers, norm, output head) and ``KV`` the K/V bytes
the step attends (vlkv: its own count; transformers: the full cache), the fraction of that bound
reached, the speed ratio against the faster transformers cache and against vlkv's full cache (paired per
round; a ``+kernel`` configuration against ``full-kernel``), the paged attention calls' own time per step
(the K/V read alone; a statistics step's probabilities and output included) and its fraction of
``KV / bandwidth``, torch (aten) ops per step and the
bytes a step gathers into scratch copies (the CPU paged read's gathers; 0 for transformers).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import vlkv.plugins.decode_layer as decode_layer
import vlkv.plugins.evict_rows as evict_rows
import vlkv.plugins.paged_append as paged_append
import vlkv.plugins.paged_cpu as paged_cpu
import vlkv.plugins.paged_cpu_heap as paged_cpu_heap
import vlkv.plugins.skinny_gemm as skinny_gemm
import vlkv.runtime.models.skinny_layer as skinny_layer
import vlkv.runtime.policies.base as policy_base
import vlkv.runtime.policies.ranking as ranking
from vlkv.runtime.engine import Engine
from vlkv.runtime.policies import make_policy

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pool_pages  # noqa: E402
from bench_common import (
    LAYOUTS,
    add_shape_args,
    add_threads_arg,
    apply_tiny,
    cpu_name,
    load_for_bench,
    machine_name,
    read_bandwidth,
    write_report,
)  # noqa: E402
from bench_decode import weight_bytes  # noqa: E402
from bench_decode_peers import hf_steps  # noqa: E402
from decode_bound_rows import GEMM_FORMS, base_config, paired, to_markdown  # noqa: E402
from decode_prefilled import Prefilled, old_kept_but, vlkv_steps  # noqa: E402
from decode_reads import HalvesRead  # noqa: E402

POLICIES = ("h2o", "snapkv", "vlcache", "pyramidkv")
BUDGETS = (0.5, 0.2, 0.1)
# per-head caches (issue #30: per-head budgets that pay off at decode): ``--policies kvzip kvgrad snapkv
# --budgets 0.5 0.25 0.1 --kernel --kernel-policies``
HEADS_POLICIES = ("kvzip", "kvgrad", "snapkv")
TINY = {"model": "tiny-llava", "tokens": 64, "batch": 2, "steps": 3, "repeats": 1, "buffer_mib": 64}


def runtime_lines() -> int:
    """Lines of ``vlkv/runtime/`` (Python), the size the issue tracks beside the speed."""
    root = Path(__file__).resolve().parents[1] / "vlkv" / "runtime"
    return sum(len(p.read_text().splitlines()) for p in root.rglob("*.py"))


def run(args) -> dict:
    before = read_bandwidth(args.buffer_mib)
    engine = Engine(load_for_bench(args.model, "cpu", "fp32"))
    peer = load_for_bench(args.model, "cpu", "fp32").model
    for cfg in (peer.config, peer.config.get_text_config()):
        cfg._attn_implementation = "sdpa"
    pols = {f"{n}@{b}": make_policy(n, budget=b) for n in args.policies for b in args.budgets}
    t0 = time.perf_counter()
    pre = Prefilled(engine, args.model, args.tokens, args.batch, pols, args.layout)
    prefill_s = time.perf_counter() - t0
    w = weight_bytes(engine)
    full = make_policy("full")
    fused_default = paged_cpu.FUSED_KERNEL
    extra = [*(["full-dense"] if args.dense else []), *(["full-kernel"] if args.kernel else [])]
    kernel_pols = [f"{p}+kernel" for p in pols] if args.kernel_policies else []
    halves_pols = [f"{p}+halves" for p in pols] if args.stats_halves else []
    plain = [] if args.skip_matmul else ["full", *pols]
    torch_gemm = [f"{c}+torchgemm" for c in (["full-kernel"] if args.kernel else []) + kernel_pols]
    torch_gemm = torch_gemm if args.torch_gemm else []
    fused = (["full-kernel"] if args.kernel else []) + kernel_pols
    split = [f"{c}+split" for c in fused] if args.split_append else []
    gemm_s7 = [f"{c}+gemms7" for c in fused] if args.gemm_s7 else []
    gemm_s8 = [f"{c}+gemms8" for c in fused] if args.gemm_s8 else []
    heap_default = [f"{c}+heapdefault" for c in fused] if args.heap_default else []
    # only the policies that evict while decoding have an eviction to compare
    evicting = [c for c in kernel_pols if pols[c.removesuffix("+kernel")].evicts_during_decode]
    torch_evict = [f"{c}+torchevict" for c in evicting] if args.torch_evict else []
    configs = [
        *plain[:1],
        *extra,
        *args.peers,
        *plain[1:],
        *kernel_pols,
        *halves_pols,
        *torch_gemm,
        *split,
        *torch_evict,
        *gemm_s7,
        *gemm_s8,
        *heap_default,
    ]
    kv_4k = pool_pages.twins([c for c in configs if c not in args.peers and base_config(c) == c], args.kv_4k)
    configs = paired(configs + kv_4k)
    append_default = paged_append.FUSED_APPEND
    evict_default = evict_rows.FUSED_DROP
    gemm_default = skinny_gemm.CPP_GEMM
    # every C++ GEMM call counted, so a row shows which GEMMs it ran (the switch is not evidence)
    cpp_calls, real_linear = [0], skinny_gemm.linear

    def counted_linear(*a, **k):
        cpp_calls[0] += 1
        return real_linear(*a, **k)

    skinny_gemm.linear = counted_linear
    got: dict[str, list[dict]] = {c: [] for c in configs}
    for rep in range(args.repeats + 1):  # the first round warms up (allocations, one-off table growth)
        order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
        for name in order:
            if name in args.peers:
                res = hf_steps(peer, pre, name, args.steps)
            else:
                cpp_calls[0] = 0
                # "+split": the Python append and a separate paged read (the fused append's before)
                paged_append.FUSED_APPEND = append_default and not name.endswith("+split")
                # "+torchevict": each layer's decode eviction by torch ops (the one-call drop's before)
                evict_rows.FUSED_DROP = evict_default and not name.endswith("+torchevict")
                kept_but = ranking.kept_but
                if name.endswith("+torchevict"):  # and the kept columns by the int64 + bool sum
                    ranking.kept_but = policy_base.kept_but = old_kept_but
                cfg = base_config(name)
                # "+gemms7" / "+gemms8": the GEMMs in session 7's / 8's form; else this CPU kind's default
                form = next(
                    (f for s, f in GEMM_FORMS.items() if name.endswith(s)), skinny_gemm.default_form()
                )
                decode_layer.set_gemm_form(form)
                # "+heapdefault": glibc's thresholds fixed at their defaults (freed blocks given back)
                heap_set = (
                    paged_cpu_heap.set_heap(False)
                    if name.endswith("+heapdefault")
                    else paged_cpu_heap.keep_freed()
                )
                skinny_gemm.CPP_GEMM = gemm_default and not name.endswith("+torchgemm")
                base = cfg.removesuffix("+kernel").removesuffix("+halves")
                pol = pols.get(base, full)
                key = base.split("@")[0] if base in pols else None
                # the fused C++ decode read only for its own configurations (the first round, untimed,
                # pays its one-off compile); "+halves": the fused read, statistics by the two halves
                halves = name.endswith("+halves")
                paged_cpu.FUSED_KERNEL = cfg == "full-kernel" or cfg.endswith("+kernel") or halves
                try:
                    # "+kv4k": the pool's K/V in 4 KiB pages (every other row: in huge pages)
                    with pool_pages.pool_pages(name, pre) as pages:
                        if halves:
                            with HalvesRead():
                                res = vlkv_steps(pre, pol, args.steps, key)
                        else:
                            res = vlkv_steps(pre, pol, args.steps, key, dense=name == "full-dense")
                    res.update(pages)
                finally:
                    paged_cpu.FUSED_KERNEL = fused_default
                    skinny_gemm.CPP_GEMM = gemm_default
                    paged_append.FUSED_APPEND = append_default
                    evict_rows.FUSED_DROP = evict_default
                    ranking.kept_but = policy_base.kept_but = kept_but
                    decode_layer.set_gemm_form(skinny_gemm.default_form())
                    paged_cpu_heap.keep_freed()
                res["cpp_gemm_calls"] = cpp_calls[0] / args.steps
                res["heap_set"] = heap_set
            if rep:
                got[name].append(res)
            print(f"  round {rep}: {name} {1e3 * res['step_s']:.1f} ms/step", flush=True)
    skinny_gemm.linear = real_linear
    # measured again after the timed rounds: the best of the two is the bound's bandwidth (on a shared
    # machine the bound would otherwise move with whatever else ran at the start)
    after = read_bandwidth(args.buffer_mib)
    bandwidth = max(before, after)
    rows = []
    peer_ms = {p: 1e3 * statistics.median(r["step_s"] for r in got[p]) for p in args.peers}
    fastest = min(peer_ms, key=peer_ms.get) if peer_ms else None
    for name in configs:
        rs = got[name]
        step_ms = 1e3 * statistics.median(r["step_s"] for r in rs)
        kv = statistics.median(r["kv_bytes"] for r in rs)
        bound_ms = 1e3 * (w + kv) / bandwidth
        attn_ms = 1e3 * statistics.median(r.get("attn_s", 0.0) for r in rs)  # 0: a peer
        row = {
            "config": name,
            "step_ms": step_ms,
            # every timed round's step, in round order (the paired ratios' ranges are read from these)
            "step_ms_rounds": [1e3 * r["step_s"] for r in rs],
            # the paged attention calls alone: the K/V read, against the bandwidth (its own bound)
            "attn_ms": attn_ms,
            "attn_of_bound": (1e3 * kv / bandwidth) / attn_ms if attn_ms > 0 else 0.0,
            "kv_bytes": kv,
            "bound_ms": bound_ms,
            "of_bound": bound_ms / step_ms,
            "ops_per_step": rs[-1]["ops"],
            "gathered_bytes": rs[-1]["gathered_bytes"],
            "cpp_gemm_calls_per_step": rs[-1].get("cpp_gemm_calls", 0.0),  # 0: torch's GEMMs (or a peer)
            "bytes_per_step": w + kv + 2 * rs[-1]["gathered_bytes"],
            "kv_huge_share": rs[-1].get(
                "kv_huge_share"
            ),  # of the pool's mappings in huge pages (None: a peer)
        }
        base_name = base_config(name)
        kernel_read = base_name.endswith(("+kernel", "+halves")) or "full" not in got
        ref = "full-kernel" if kernel_read and "full-kernel" in got else "full"
        row["speed_vs_full"] = statistics.median(
            f["step_s"] / r["step_s"] for f, r in zip(got[ref], rs, strict=True)
        )
        # against its before rows (the fused append, the one-call eviction, the GEMM's session-7 form),
        # paired per round: speed_vs_split / speed_vs_torchevict / speed_vs_gemms7
        for suffix in ("+split", "+torchevict", "+gemms7", "+gemms8", "+heapdefault", pool_pages.SUFFIX):
            if f"{name}{suffix}" in got:
                row[f"speed_vs_{suffix[1:]}"] = statistics.median(
                    s["step_s"] / r["step_s"] for s, r in zip(got[f"{name}{suffix}"], rs, strict=True)
                )
        row["attn_vs_kv4k"] = pool_pages.paired_speed(got, name, "attn_s")  # the read alone, paired
        if fastest is not None:
            # paired within each round: the faster peer's step time / this one's, median over rounds
            row["speed_vs_fastest_peer"] = statistics.median(
                p["step_s"] / r["step_s"] for p, r in zip(got[fastest], rs, strict=True)
            )
        rows.append(row)
    same = {p: got[p][0]["tokens"] == got[configs[0]][0]["tokens"] for p in args.peers}
    # a statistics step by the kernel and by the two halves decode the same tokens
    same.update(
        {
            f"{p}+kernel=+halves": got[f"{p}+kernel"][0]["tokens"] == got[f"{p}+halves"][0]["tokens"]
            for p in pols
        }
        if args.kernel_policies and args.stats_halves
        else {}
    )
    # each before row decodes its configuration's tokens: the C++ GEMM sums in another order than torch
    # (tokens must not move), the fused append writes and reads what the Python append and the separate
    # read did, the one-call eviction keeps what each layer's torch edit kept, the GEMM's forms are bit-equal
    same.update(
        {
            c: got[c][0]["tokens"] == got[base_config(c)][0]["tokens"]
            for c in (*torch_gemm, *split, *torch_evict, *gemm_s7, *gemm_s8, *heap_default, *kv_4k)
        }
    )
    return {
        "machine": f"{cpu_name()} ({machine_name('cpu')})",
        "threads": torch.get_num_threads(),
        "cpp_gemm": gemm_default and skinny_gemm.kernel() is not None,
        "fused_append": append_default and paged_append.kernel() is not None,
        "fused_evict": evict_default and evict_rows.kernel() is not None,
        "heap_keeps_freed": paged_cpu_heap.keep_freed(),
        "model": args.model,
        "dtype": "fp32",
        "batch": args.batch,
        "prompt_tokens": int(pre.one.input_ids.shape[1]),
        "layout": args.layout,
        "steps": args.steps,
        "repeats": args.repeats,
        "bandwidth_gb_s": bandwidth / 1e9,
        "bandwidth_before_after_gb_s": [before / 1e9, after / 1e9],
        "buffer_mib": args.buffer_mib,
        "weight_bytes": w,
        "prefill_s": prefill_s,
        "replay_s": pre.replay_s,
        "fastest_peer": fastest,
        "runtime_lines": runtime_lines(),
        "peers_same_tokens": same,
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap, tokens=2048, steps=8, tiny_help="tiny-llava, 64 tokens × 2, a few steps (tests)")
    ap.add_argument(
        "--layout",
        choices=LAYOUTS,
        default=LAYOUTS[0],
        help="document-first: document, image, question (A-VL keeps the whole document, its system "
        "region); image-first: image, document, question (A-VL's text budget covers the document)",
    )
    ap.add_argument("--policies", nargs="*", default=list(POLICIES))
    ap.add_argument("--budgets", nargs="+", type=float, default=list(BUDGETS))
    ap.add_argument("--peers", nargs="*", choices=["static", "dynamic"], default=["static", "dynamic"])
    ap.add_argument(
        "--dense",
        action="store_true",
        help="also run the full cache read as before paged reads (a padded scratch copy per layer)",
    )
    ap.add_argument(
        "--kernel",
        action="store_true",
        help="also the full cache with the fused C++ CPU decode read (VLKV_CPU_KERNEL=1) as its own configuration",
    )
    ap.add_argument(
        "--kernel-policies",
        action="store_true",
        help="also each policy configuration with the fused C++ CPU decode read, as '<config>+kernel'",
    )
    ap.add_argument(
        "--stats-halves",
        action="store_true",
        help="also each policy configuration with the fused read but its statistics steps by paged_probs' "
        "two halves (per-head tables gathered), as '<config>+halves'",
    )
    ap.add_argument(
        "--skip-matmul",
        action="store_true",
        help="drop the configurations read without the fused kernel ('full' and the plain policy ones)",
    )
    ap.add_argument(
        "--torch-gemm",
        action="store_true",
        help="also each fused configuration with the decode GEMMs, RMSNorms and RoPE by torch "
        "(VLKV_CPU_GEMM=0 switches the C++ GEMM and layer glue together), as '<config>+torchgemm'",
    )
    ap.add_argument(
        "--split-append",
        action="store_true",
        help="also each fused configuration with the decode layers' cache append in Python and the paged "
        "read a separate call (VLKV_CPU_APPEND=0, the fused append's before), as '<config>+split'",
    )
    ap.add_argument(
        "--torch-evict",
        action="store_true",
        help="also each '<config>+kernel' with its decode eviction by torch ops per layer (VLKV_CPU_EVICT=0) "
        "and the kept columns by an int64 + bool sum (the session-7 changes' before), as "
        "'<config>+kernel+torchevict'",
    )
    ap.add_argument(
        "--gemm-s7",
        action="store_true",
        help="also each fused configuration with the few-row GEMMs in their session-7 form (bit-equal), "
        "as '<config>+gemms7'",
    )
    ap.add_argument(
        "--gemm-s8",
        action="store_true",
        help="also each fused configuration with the few-row GEMMs in their session-8 form (2 weight rows per "
        "block at 3-8 rows, lines into L1; bit-equal), as '<config>+gemms8'",
    )
    ap.add_argument(
        "--heap-default",
        action="store_true",
        help="also each fused configuration with the C heap's thresholds at glibc's defaults (freed blocks "
        "given back, the statistics steps' probabilities faulted in again each step: the before of "
        "vlkv/plugins/paged_cpu_heap.py), as '<config>+heapdefault'",
    )
    pool_pages.add_arg(ap)
    ap.add_argument("--buffer-mib", type=int, default=2048, help="bandwidth buffer (far above the L3)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    add_threads_arg(ap)
    args = ap.parse_args()
    apply_tiny(ap, args, TINY)
    if args.tiny:
        # tiny-llava's weights are all below the C++ GEMM's floor: let them take it, so the tiny run
        # exercises the same GEMM path (and --torch-gemm's switch) as a real model
        skinny_layer.SKINNY_MIN_WEIGHT = 0
    if min(args.tokens, args.batch, args.steps, args.repeats, args.buffer_mib) < 1:
        ap.error("--tokens, --batch, --steps, --repeats and --buffer-mib must be >= 1")
    if any(not 0.0 < b < 1.0 for b in args.budgets):
        ap.error("--budgets must be in (0, 1)")
    if args.skip_matmul and not args.kernel:
        ap.error("--skip-matmul needs --kernel (the full cache's configuration)")
    if args.threads < 0:
        ap.error(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    res = run(args)
    write_report(to_markdown(res), res, args)


if __name__ == "__main__":
    main()
