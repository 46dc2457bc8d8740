"""Decode where the KV cache dominates: step time per policy and budget beside the bandwidth limit.

    python scripts/bench_decode.py --model smollm2-llava --tokens 1024 2048 4096 --batch 4 \\
        --json out.json --plot out.png

For each context length, ``--batch`` copies of a document + image + question prompt are prefilled
once with the full cache, with every policy's statistics request computed in that same pass (each
as a named extra request). Every configuration then starts from its own copy of that cache, applies
its policy's prefill edits and runs ``--steps`` decode steps (greedy) through ``Engine.decode``; the
full cache runs in every repeat too, interleaved, so each ratio pairs times of the same repeat.

The bandwidth limit: a decode step reads the weights once (``W``: the language model's layers and
its output head) and the K/V entries it attends (``KV``: entries × 2 × H_kv × D × bytes, from the
step's own count of attended entries). If time were bytes, a policy reading ``W + KV_p`` would run
``(W + KV_full) / (W + KV_p)`` times faster than the full cache; "of limit" = measured speed-up over
that.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from vlkv.runtime.backend import StatsRequest, StepInputs, StepStats
from vlkv.runtime.edits import apply_edits
from vlkv.runtime.engine import Engine
from vlkv.runtime.policies import make_policy, policy_fields

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    add_device_args,
    add_threads_arg,
    check_device_args,
    document_prompt,
    load_for_bench,
    machine_name,
    sync,
)

POLICIES = ("snapkv", "vlcache", "pyramidkv", "local", "h2o", "elastic", "avl")
COMPRESS_ONCE = ("snapkv", "vlcache", "pyramidkv")
BUDGETS = (0.5, 0.2, 0.1)


def weight_bytes(engine: Engine) -> int:
    """Bytes of weights one decode step reads: the decoder layers, the final norm and the output head."""
    ad = engine.backend.adapter
    seen: dict[int, int] = {}
    for module in (ad.layers, ad.norm, ad.lm_head):
        for p in module.parameters():
            seen[id(p)] = p.numel() * p.element_size()
    return sum(seen.values())


def joint_request(policies: dict, ctx, rows: int) -> tuple[StatsRequest, dict[str, str]]:
    """One request carrying every policy's own prefill request as a named extra (``name`` or
    ``name/extra``), so one prefill serves them all; identical every-row requests are computed once.

    Returns the request and ``alias``: policy name → the extra whose statistics it reads.
    """
    extra: dict[str, StatsRequest] = {}
    alias: dict[str, str] = {}
    every: dict[tuple, str] = {}
    for name, pol in policies.items():
        req = pol.prefill_request(ctx, rows)
        if req is None:
            continue
        if req.rows is None and not req.extra:
            key = (req.threshold, req.layers)
            if key in every:
                alias[name] = every[key]
                continue
            every[key] = name
        alias[name] = name
        extra[name] = StatsRequest(rows=req.rows, threshold=req.threshold, layers=req.layers)
        for sub, sreq in req.extra.items():
            extra[f"{name}/{sub}"] = sreq
    none = torch.zeros(ctx.prompt_lengths.shape[0], rows, dtype=torch.bool, device=ctx.prompt_lengths.device)
    return StatsRequest(rows=none, extra=extra), alias


def stats_for(stats: StepStats, name: str) -> StepStats:
    """The per-layer statistics of the extra ``name`` out of a joint prefill."""
    subs = {k.split("/", 1)[1]: v for k, v in stats.extra.items() if k.startswith(f"{name}/")}
    return StepStats(stats.extra.get(name, [None] * len(stats)), subs)


def copy_cache(engine: Engine, batch, src):
    """A fresh cache (own pool) holding ``src``'s entries: an uncompressed prefill, read back and
    appended in one step."""
    dst = engine.new_cache(batch)
    for a, b in zip(src.layers, dst.layers):
        k, v = a.attention_kv()
        n = a.max_length
        b.append(k, v, a.positions[:, 0, :n], a.modality[:, 0, :n], a.lengths, a.order[:, 0, :n])
    dst.processed = src.processed.clone()
    return dst


def run_length(engine: Engine, args, tokens: int, configs: list[tuple[str, float]]) -> list[dict]:
    be = engine.backend
    batch = _repeat(document_prompt(engine, args.model, tokens), args.batch)
    t = batch.input_ids.shape[1]
    ctx = engine.context(batch)
    pols = {f"{n}@{b}": make_policy(n, budget=b, **cadence(n, args)) for n, b in configs if n != "full"}
    names_by_kind = {}
    for key in pols:
        names_by_kind.setdefault(key.split("@")[0], key)
    # prefill requests depend on the policy kind, not its budget: one extra per kind
    request, alias = joint_request({k: pols[v] for k, v in names_by_kind.items()}, ctx, t)
    cache = engine.new_cache(batch)
    inputs = StepInputs(batch.input_ids, batch.positions, batch.modality, batch.lengths, be.embed(batch))
    out = be.step(inputs, cache, request)
    first = out.logits.argmax(-1)
    entry = 2 * be.num_kv_heads * be.head_dim * torch.finfo(be.dtype).bits // 8
    w = weight_bytes(engine)

    # with a cadence one step in ``every`` evicts: the mean carries its cost, a median would not
    agg = statistics.mean if args.evict_every > 1 else statistics.median

    def begin(name: str, budget: float) -> list:
        """A configuration's own copy of the prefilled cache after its policy's prefill edits:
        ``[policy, cache, next tokens]``."""
        pol = make_policy(name) if name == "full" else pols[f"{name}@{budget}"]
        c = copy_cache(engine, batch, cache)
        if name != "full":
            apply_edits(c, pol.after_prefill(c, stats_for(out.stats, alias.get(name, name)), ctx))
        return [pol, c, first]

    def advance(state: list, step: int) -> tuple[float, float]:
        """One decode step of a configuration: seconds and K/V bytes attended."""
        pol, c, tok = state
        sync(args.device)
        start = time.perf_counter()
        res = engine.decode(tok, batch, pol, c, step + 1)
        sync(args.device)
        seconds = time.perf_counter() - start
        state[2] = res.logits.argmax(-1)
        return seconds, float(res.attended.sum()) * entry if res.attended is not None else float("nan")

    def decode(name: str, budget: float) -> tuple[float, float]:
        """Step seconds and K/V bytes attended per step (median, or mean under a cadence)."""
        state = begin(name, budget)
        # the first step pays one-off growth of the tables
        timed = [advance(state, step) for step in range(args.steps + 1)][1:]
        state[1].release()
        return agg([t for t, _ in timed]), agg([r for _, r in timed])

    def lockstep(confs: list[tuple[str, float]]) -> dict:
        """Every configuration and the full cache one decode step at a time, in a rotating order, so
        a drift of the machine's speed hits them alike. Returns, per configuration, ``((full step,
        full read), (step, read))`` where ``step`` is the aggregate over steps of the *paired* ratio
        (time / full time within one round) applied to the full step's aggregate."""
        keys = [("full", 1.0), *confs]
        state = {key: begin(*key) for key in keys}
        timed: dict = {key: [] for key in keys}
        for step in range(args.steps + 1):
            shift = step % len(keys)
            for key in keys[shift:] + keys[:shift]:
                got = advance(state[key], step)
                if step:  # the first step pays one-off growth of the tables
                    timed[key].append(got)
        for st in state.values():
            st[1].release()
        base = timed[keys[0]]
        full = (agg([t for t, _ in base]), agg([r for _, r in base]))
        pairs = {}
        for key in confs:
            ratio = agg([t / f for (t, _), (f, _) in zip(timed[key], base)])
            pairs[key] = (full, (ratio * full[0], agg([r for _, r in timed[key]])))
            print(
                f"  {tokens} tokens: {key[0]} {key[1]}: {1e3 * pairs[key][1][0]:.1f} ms vs full "
                f"{1e3 * full[0]:.1f} ms (interleaved)",
                flush=True,
            )
        return pairs

    decode("full", 1.0)  # warm-up
    runs: dict[tuple[str, float], list[tuple[float, float]]] = {c: [] for c in configs}
    # one full-cache run before each policy's budgets, paired with each of them
    full_of: dict[tuple[str, float], list[tuple[float, float]]] = {c: [] for c in configs}
    if args.interleave:
        for _ in range(args.repeats):
            for c, pair in lockstep(configs).items():
                full_of[c].append(pair[0])
                runs[c].append(pair[1])
    else:
        for _ in range(args.repeats):
            for i, c in enumerate(configs):
                if i == 0 or configs[i - 1][0] != c[0]:
                    full = decode("full", 1.0)
                runs[c].append(decode(*c))
                full_of[c].append(full)
                print(
                    f"  {tokens} tokens: {c[0]} {c[1]}: {1e3 * runs[c][-1][0]:.1f} ms vs full {1e3 * full[0]:.1f} ms",
                    flush=True,
                )
    rows = []
    for (name, budget), rs in runs.items():
        pairs = list(zip(full_of[(name, budget)], rs))
        speed = statistics.median(f[0] / p[0] for f, p in pairs)
        kv_full = statistics.median(f[1] for f, _ in pairs)
        kv_pol = statistics.median(p[1] for _, p in pairs)
        limit = (w + kv_full) / (w + kv_pol)
        rows.append(
            {
                "tokens": t,
                "batch": args.batch,
                "policy": name,
                "budget": budget,
                "step_ms": 1e3 * statistics.median(p[0] for _, p in pairs),
                "full_step_ms": 1e3 * statistics.median(f[0] for f, _ in pairs),
                "weight_bytes": w,
                "kv_read_bytes": kv_pol,
                "kv_full_bytes": kv_full,
                "speedup": speed,
                "limit": limit,
                "of_limit": speed / limit,
            }
        )
    cache.release()
    return rows


def _repeat(prompt_batch, b: int):
    """``prompt_batch`` (one encoded prompt) as a batch of ``b`` identical rows."""
    from vlkv.runtime.prompt import collate

    enc = prompt_batch.prompts[0]
    return collate([enc] * b, 0)


def to_markdown(res: dict) -> str:
    lines = [
        f"Decode step vs the bandwidth limit ({res['dtype']}, {res['machine']}, batch {res['batch']}, "
        f"{'median' if res.get('evict_every', 1) == 1 else 'mean'} of {res['steps']} steps"
        + (f", decode eviction every {res['evict_every']} steps" if res.get("evict_every", 1) > 1 else "")
        + (
            "; every configuration stepped in lockstep with the full cache, each step paired with the "
            "full step of its round)"
            if res.get("interleave")
            else "; each policy's budgets paired with a full-cache run just before them)"
        ),
        "",
        "W = weight bytes read per step; KV = K/V bytes the step attends. limit = (W + KV_full) / (W + KV);",
        "of limit = measured speed-up over the full cache / limit.",
        "",
        "| context | policy | budget | step (ms) | full step (ms) | KV / W | speed-up vs full | limit | of limit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['tokens']} | {r['policy']} | {r['budget']} | {r['step_ms']:.1f} | {r['full_step_ms']:.1f} "
            f"| {r['kv_read_bytes'] / r['weight_bytes']:.2f} | {r['speedup']:.2f}× | {r['limit']:.2f}× "
            f"| {r['of_limit']:.0%} |"
        )
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str) -> bool:
    """Speed-up over the full cache vs context per policy at ``res['plot_budget']``, each with its
    bandwidth limit (dotted); ratios, since absolute times on a shared CPU drift between runs."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    if len({r["tokens"] for r in res["rows"]}) == 1:
        fig, ax = _plot_one_context(plt, res)
    else:
        budget = res["plot_budget"]
        rows = [r for r in res["rows"] if r["budget"] == budget]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ax.axhline(1.0, color="k", lw=1, label="full")
        for name in sorted({r["policy"] for r in rows}):
            pts = sorted((r["tokens"], r["speedup"], r["limit"]) for r in rows if r["policy"] == name)
            (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", label=name)
            ax.plot([p[0] for p in pts], [p[2] for p in pts], ":", color=line.get_color())
        ax.set_xlabel("context tokens per sample")
        ax.set_ylabel("decode step speed-up over the full cache")
        ax.set_title(f"budget {budget}, batch {res['batch']} (dotted: (W + KV_full) / (W + KV) limit)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def _plot_one_context(plt, res: dict):
    """One context length: speed-up per policy (bars) at every budget, the limit as a black tick."""
    rows = res["rows"]
    budgets = sorted({r["budget"] for r in rows}, reverse=True)
    names = sorted({r["policy"] for r in rows})
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.axhline(1.0, color="k", lw=1, label="full")
    for i, name in enumerate(names):
        for j, b in enumerate(budgets):
            r = next((r for r in rows if r["policy"] == name and r["budget"] == b), None)
            if r is None:
                continue
            x = j + (i - (len(names) - 1) / 2) * width
            ax.bar(x, r["speedup"], width * 0.9, color=f"C{i}", label=name if j == 0 else None)
            ax.plot([x - width / 2, x + width / 2], [r["limit"]] * 2, "k-", lw=2)
            ax.text(x, r["speedup"], f"{100 * r['of_limit']:.0f}%", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(budgets)), [f"budget {b}" for b in budgets])
    ax.set_ylabel("decode step speed-up over the full cache")
    every = res.get("evict_every", 1)
    ax.set_title(
        f"{rows[0]['tokens']} tokens × batch {res['batch']}"
        + (f", eviction every {every} steps" if every > 1 else "")
        + "\nblack: the bandwidth limit; label: % of it",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    return fig, ax


def cadence(name: str, args) -> dict:
    """``evict_every`` for a policy that evicts while decoding, when ``--evict-every`` asks for it."""
    if args.evict_every > 1 and "evict_every" in policy_fields(name):
        return {"evict_every": args.evict_every}
    return {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-llava")
    ap.add_argument("--tokens", nargs="+", type=int, default=[1024, 2048, 4096], help="context lengths")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--budgets", nargs="+", type=float, default=list(BUDGETS))
    ap.add_argument("--steps", type=int, default=6, help="decode steps timed per configuration")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--evict-every",
        type=int,
        default=1,
        help="run the decode-time eviction of h2o/local/elastic every N steps (their evict_every)",
    )
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="run every configuration and the full cache one step at a time in a rotating order "
        "(pairs each step with a full step of the same round; needs every configuration's cache at once)",
    )
    ap.add_argument("--plot-budget", type=float, default=0.2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG path (needs matplotlib)")
    add_device_args(ap)
    add_threads_arg(ap)
    args = ap.parse_args()
    check_device_args(ap, args)
    if args.batch < 1 or args.steps < 1 or args.repeats < 1 or args.evict_every < 1 or min(args.tokens) < 16:
        ap.error("--batch, --steps, --repeats, --evict-every must be >= 1 and --tokens >= 16")
    if args.steps % args.evict_every:
        ap.error(f"--steps ({args.steps}) must be a multiple of --evict-every ({args.evict_every})")
    if any(not 0.0 < b < 1.0 for b in args.budgets):
        ap.error("--budgets must be in (0, 1)")
    engine = Engine(load_for_bench(args.model, args.device, args.dtype))
    configs = [(p, b) for p in args.policies for b in args.budgets]
    rows = []
    for t in args.tokens:
        rows += run_length(engine, args, t, configs)
        print(f"{t} tokens done", flush=True)
    res = {
        "machine": machine_name(args.device),
        "dtype": args.dtype,
        "batch": args.batch,
        "steps": args.steps,
        "repeats": args.repeats,
        "plot_budget": args.plot_budget,
        "evict_every": args.evict_every,
        "interleave": args.interleave,
        "compress_once": list(COMPRESS_ONCE),
        "rows": rows,
    }
    print(to_markdown(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    if args.plot:
        plot(res, args.plot)


if __name__ == "__main__":
    main()
