"""Where a decode step's time goes, each part against its own byte bound, in one run (CPU).

    python scripts/bench_decode_parts.py --model smollm2-llava --tokens 8192 --batch 4 --threads 1 \\
        --policies snapkv h2o --budgets 0.1 --json parts.json --md parts.md
    python scripts/bench_decode_parts.py --tiny      # seconds: tiny-llava, for the tests

One prompt prefilled once (``decode_prefilled.Prefilled``); per round, in a rotating order, ``--steps``
greedy decode steps of each configuration (``full`` and each ``policy@budget``, the fused C++ read on;
with ``--forms``, each again per few-row GEMM form, ``<config>/<form>``: ``set_gemm_form``'s 0 the
kernel's, 1 session 7's, 2 session 8's, bit-equal; with ``--kv-4k`` each right after itself with its KV
pool in 4 KiB pages, ``<config>+kv4k``, see ``pool_pages.py``), every part timed by wrapping
the function the step calls for it:

- ``pre`` / ``post``: the 30 decoder layers' two C++ calls (``decode_layer.pre``: norm, q/k/v GEMMs,
  RoPE; ``post``: o GEMM, residual, norm, gate/up/down GEMMs, SiLU, residual) — the layers' weights;
- ``attention``: the fused append + paged read (``paged_append.append_attend``) — the K/V attended;
- ``head``: the final norm's output through the output head (``adapter.head``) — the head's weight;
- ``policy``: the policy's decode hook and the edits it returns (``after_decode`` + ``apply_edits``);
- ``rest``: the step minus the above (embedding, RoPE tables, the step context, Python glue).

And in the same process, with no cache read between them (``alone``): the same 30 layers' ``pre`` +
``post`` and the head back to back on the same weights and rows, a ``sum`` over those weights (their own
read rate, in their placement) and the STREAM-like ``sum`` probe over a buffer far larger than the L3.
Each part's GB/s is its bytes over its median time; ``of read`` divides by the probe's rate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

import vlkv.plugins.decode_layer as decode_layer
import vlkv.plugins.paged_append as paged_append
import vlkv.plugins.paged_cpu as paged_cpu
import vlkv.runtime.engine as engine_mod
import vlkv.runtime.models.skinny_layer as skinny_layer
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
from decode_prefilled import Prefilled, vlkv_steps  # noqa: E402

PARTS = ("pre", "post", "attention", "head", "policy")
TINY = {"model": "tiny-llava", "tokens": 64, "batch": 2, "steps": 2, "repeats": 1, "buffer_mib": 64}


@contextmanager
def patched(obj, name: str, add):
    """``obj.name`` wrapped so that each call's wall time is added by ``add(seconds)``."""
    real = getattr(obj, name)

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            add(time.perf_counter() - t)

    setattr(obj, name, timed)
    try:
        yield
    finally:
        setattr(obj, name, real)


def timed_steps(pre: Prefilled, policy, steps: int, key: str | None) -> dict:
    """``vlkv_steps`` with each part's seconds per step added up (see the module docstring)."""
    secs = dict.fromkeys(PARTS, 0.0)

    def adder(part):
        def add(s):
            secs[part] += s

        return add

    adapter = pre.engine.backend.adapter
    with ExitStack() as st:
        st.enter_context(patched(decode_layer, "pre", adder("pre")))
        st.enter_context(patched(decode_layer, "post", adder("post")))
        st.enter_context(patched(paged_append, "append_attend", adder("attention")))
        st.enter_context(patched(adapter, "head", adder("head")))
        st.enter_context(patched(policy, "after_decode", adder("policy")))
        st.enter_context(patched(engine_mod._edits, "apply_edits", adder("policy")))
        res = vlkv_steps(pre, policy, steps, key)
    # steps + 1 ran, then the probe's one: the first (untimed) and the probe step are in the sums too
    for part in PARTS:
        res[part + "_s"] = secs[part] / (steps + 2)
    return res


def layer_weights(adapter) -> tuple[int, int]:
    """Bytes of the decoder layers' weights (norms included) and of the output head's."""
    layers = sum(p.numel() * p.element_size() for p in adapter.layers.parameters())
    head = adapter.lm_head.weight
    return layers, head.numel() * head.element_size()


def alone(engine: Engine, rows: int, reps: int) -> dict:
    """Seconds of the 30 layers' ``pre`` + ``post`` and of the head on the step's own weights, back to
    back with no cache read between (best / median of ``reps``), and of a ``sum`` over those weights."""
    adapter = engine.backend.adapter
    layers = list(adapter.layers)
    attn = layers[0].self_attn
    hd, hidden = attn.head_dim, adapter.lm_head.weight.shape[1]
    x = torch.randn(rows, 1, hidden)
    cos, sin = torch.randn(rows, 1, hd), torch.randn(rows, 1, hd)
    heads = attn.config.num_attention_heads
    out = torch.randn(rows, 1, heads, hd)
    head_w = adapter.lm_head.weight
    xs = torch.randn(rows, hidden)
    weights = [p for p in adapter.layers.parameters() if p.numel() >= 1 << 14]
    got = {"layers": [], "head": [], "sum_weights": []}
    with torch.no_grad():
        if decode_layer.pre(layers[0], x, cos, sin) is None:
            return {}
        for _ in range(reps):
            t = time.perf_counter()
            for layer in layers:
                decode_layer.pre(layer, x, cos, sin)
                decode_layer.post(layer, out, x)
            got["layers"].append(time.perf_counter() - t)
            t = time.perf_counter()
            skinny_layer.linear(xs, head_w)
            got["head"].append(time.perf_counter() - t)
            t = time.perf_counter()
            for w in weights:
                w.sum()
            head_w.sum()
            got["sum_weights"].append(time.perf_counter() - t)
    return {k: {"best": min(v), "median": statistics.median(v)} for k, v in got.items()}


def configs_of(args) -> list[str]:
    base = ["full", *(f"{p}@{b}" for p in args.policies for b in args.budgets)]
    base = [f"{c}/{f}" for c in base for f in args.forms] if args.forms else base
    return [x for c in base for x in (c, *pool_pages.twins([c], args.kv_4k))]  # each twin beside its config


def run(args) -> dict:
    probe_before = read_bandwidth(args.buffer_mib)
    engine = Engine(load_for_bench(args.model, "cpu", "fp32"))
    pols = {f"{p}@{b}": make_policy(p, budget=b) for p in args.policies for b in args.budgets}
    pre = Prefilled(engine, args.model, args.tokens, args.batch, pols, args.layout)
    full = make_policy("full")
    configs = configs_of(args)
    got: dict[str, list[dict]] = {c: [] for c in configs}
    lone: list[dict] = []
    fused = paged_cpu.FUSED_KERNEL
    paged_cpu.FUSED_KERNEL = True
    try:
        for rep in range(args.repeats + 1):  # round 0 warms up
            order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
            for name in order:
                base, _, form = pool_pages.base(name).partition("/")
                decode_layer.set_gemm_form(int(form or 0))
                try:
                    key = base.split("@")[0] if base in pols else None
                    with pool_pages.pool_pages(name, pre) as pages:
                        res = timed_steps(pre, pols.get(base, full), args.steps, key)
                    res.update(pages)
                finally:
                    decode_layer.set_gemm_form(0)
                if rep:
                    got[name].append(res)
                print(f"  round {rep}: {name} {1e3 * res['step_s']:.1f} ms/step", flush=True)
            if rep:
                lone.append(alone(engine, args.batch, args.alone_reps))
    finally:
        paged_cpu.FUSED_KERNEL = fused
    probe = max(probe_before, read_bandwidth(args.buffer_mib))
    layers_b, head_b = layer_weights(engine.backend.adapter)
    rows = []
    med = statistics.median
    for name in configs:
        rs = got[name]
        step = med(r["step_s"] for r in rs)
        parts = {p: med(r[p + "_s"] for r in rs) for p in PARTS}
        parts["rest"] = step - sum(parts.values())
        kv = med(r["kv_bytes"] for r in rs)
        nbytes = {"pre": None, "post": None, "attention": kv, "head": head_b}
        row = {
            "config": name,
            "step_ms": 1e3 * step,
            "kv_bytes": kv,
            "ms": {p: 1e3 * s for p, s in parts.items()},
            "kv_huge_share": rs[-1].get("kv_huge_share"),
            # paired per round against the +kv4k twin: the step and the attention (append + paged read)
            "step_vs_kv4k": pool_pages.paired_speed(got, name),
            "attention_vs_kv4k": pool_pages.paired_speed(got, name, "attention_s"),
        }
        row["layers_gb_s"] = layers_b / (parts["pre"] + parts["post"]) / 1e9 if parts["pre"] else 0.0
        row["gb_s"] = {p: b / parts[p] / 1e9 for p, b in nbytes.items() if b and parts[p] > 0}
        row["bound_ms"] = 1e3 * (layers_b + head_b + kv) / probe
        rows.append(row)
    lone_s = {}
    if lone and lone[0]:
        lone_s = {k: {s: med(x[k][s] for x in lone) for s in ("best", "median")} for k in lone[0]}
    return {
        "machine": f"{cpu_name()} ({machine_name('cpu')})",
        "threads": torch.get_num_threads(),
        "model": args.model,
        "batch": args.batch,
        "prompt_tokens": int(pre.one.input_ids.shape[1]),
        "layout": args.layout,
        "steps": args.steps,
        "repeats": args.repeats,
        "probe_gb_s": probe / 1e9,
        "weight_bytes": weight_bytes(engine),
        "layer_bytes": layers_b,
        "head_bytes": head_b,
        "alone_s": lone_s,
        "rows": rows,
    }


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:.0%}"


def _times(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}×"


def to_markdown(res: dict) -> str:
    probe = res["probe_gb_s"]
    lb, hb = res["layer_bytes"], res["head_bytes"]
    lines = [
        f"Decode step parts ({res['model']}, fp32, {res['machine']}, {res['threads']} threads; "
        f"{res['prompt_tokens']} tokens × batch {res['batch']}, {res['layout']}, median over {res['repeats']} rotating rounds "
        f"of {res['steps']} steps). Probe (sum, far above the L3): {probe:.1f} GB/s. Layers' weights "
        f"{lb / 1e6:.1f} MB, head {hb / 1e6:.1f} MB.",
        "",
        "| config | step ms | bound ms | of bound | pre + post ms (GB/s, of read) | attention ms (GB/s) | head ms (GB/s, of read) "
        "| policy ms | rest ms | KV in huge pages | step vs +kv4k | attention vs +kv4k |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        ms, g = r["ms"], r["gb_s"]
        lines.append(
            f"| {r['config']} | {r['step_ms']:.1f} | {r['bound_ms']:.1f} | {r['bound_ms'] / r['step_ms']:.0%} "
            f"| {ms['pre'] + ms['post']:.1f} ({r['layers_gb_s']:.1f}, {r['layers_gb_s'] / probe:.0%}) "
            f"| {ms['attention']:.1f} ({g.get('attention', 0):.1f}) "
            f"| {ms['head']:.1f} ({g.get('head', 0):.1f}, {g.get('head', 0) / probe:.0%}) "
            f"| {ms['policy']:.1f} | {ms['rest']:.1f} | {_pct(r['kv_huge_share'])} "
            f"| {_times(r['step_vs_kv4k'])} | {_times(r['attention_vs_kv4k'])} |"
        )
    a = res["alone_s"]
    if a:
        lines += [
            "",
            "Alone, same weights and rows, no cache read between (best / median ms, GB/s at the median):",
            "",
            "| part | best ms | median ms | GB/s | of read |",
            "|---|---:|---:|---:|---:|",
        ]
        for key, nbytes in (("layers", lb), ("head", hb), ("sum_weights", lb + hb)):
            gbs = nbytes / a[key]["median"] / 1e9
            lines.append(
                f"| {key} | {1e3 * a[key]['best']:.1f} | {1e3 * a[key]['median']:.1f} | {gbs:.1f} | {gbs / probe:.0%} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap, tokens=8192, steps=4, tiny_help="tiny-llava, a few steps (tests)")
    ap.add_argument(
        "--layout",
        choices=LAYOUTS,
        default=LAYOUTS[0],
        help="the prompt's order (as bench_decode_bound.py's --layout; image-first: A-VL's text budget "
        "covers the document)",
    )
    ap.add_argument("--policies", nargs="*", default=["snapkv", "h2o"])
    ap.add_argument("--budgets", nargs="*", type=float, default=[0.1])
    ap.add_argument(
        "--forms",
        nargs="*",
        default=[],
        choices=["0", "1", "2"],
        help="few-row GEMM forms to run each configuration in (0: the kernel's, 1: session 7's, 2: session 8's)",
    )
    pool_pages.add_arg(ap)
    ap.add_argument("--alone-reps", type=int, default=5)
    ap.add_argument("--buffer-mib", type=int, default=2048)
    ap.add_argument("--json")
    ap.add_argument("--md")
    add_threads_arg(ap)
    args = ap.parse_args()
    apply_tiny(ap, args, TINY)
    if args.tiny:
        skinny_layer.SKINNY_MIN_WEIGHT = 0
    if args.threads:
        torch.set_num_threads(args.threads)
    res = run(args)
    write_report(to_markdown(res), res, args)


if __name__ == "__main__":
    main()
