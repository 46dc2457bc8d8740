"""The real-text comparison: vlkv policies and kvpress presses on the continuation protocol
(:mod:`vlkv.eval.continuation`), stored per configuration so a long run resumes where it stopped,
and reported with paired bootstrap intervals.

A configuration is a spec string ``name[:key=value,...]`` (``"snapkv:window=64,kernel=5"``) at a
budget. Results live in ``<out>/nll/<side>/<label>.pt`` (``side`` = ``vlkv`` or ``kvpress``);
:func:`report` reads whatever is there.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from vlkv.eval.continuation import Window, paired_delta, ppl, run_protocol

__all__ = ["KVPRESS_CONFIGS", "MATCHED", "VLKV_CONFIGS", "mean_interval", "parse_spec", "report", "run_side"]

# Ordered by what the comparison needs first: a run cut short still answers the main questions.
VLKV_CONFIGS = (
    "snapkv:window=64,kernel=5",
    "snapkv:window=32,kernel=7",
    "pyramidkv:window=64,kernel=5,fallback=true",
    "pyramidkv:window=64,kernel=5",
    "h2o",
    "local",
    "snapkv:window=32,kernel=5",
    "snapkv:window=64,kernel=7",
    "kvzip:heads=adaptive",
    "kvgrad:heads=adaptive",
    "kvzip:heads=own",
    "kvgrad:heads=own",
)
KVPRESS_CONFIGS = (
    "snapkv:window_size=64,kernel_size=5",
    "snapkv:window_size=32,kernel_size=7",
    "tova",
    "observed_attention",
    "streaming_llm:n_sink=4",
    "knorm",
    "expected_attention",
    "pyramidkv:window_size=64,kernel_size=5,beta=20",
    "kvzip",
    "kvgrad",
)


# every row is also compared, paired, with this vlkv configuration (the snapkv default)
REFERENCE = "snapkv:window=64,kernel=5"
# (vlkv spec, kvpress spec) pairs that implement one method with the same settings
MATCHED = (
    ("snapkv:window=64,kernel=5", "snapkv:window_size=64,kernel_size=5"),
    ("snapkv:window=32,kernel=7", "snapkv:window_size=32,kernel_size=7"),
    ("pyramidkv:window=64,kernel=5,fallback=true", "pyramidkv:window_size=64,kernel_size=5,beta=20"),
    ("local", "streaming_llm:n_sink=4"),
    ("kvzip:heads=adaptive", "kvzip"),  # kvpress masks per head after one ranking: non-uniform head budgets
    ("kvgrad:heads=adaptive", "kvgrad"),
)


def _value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_spec(spec: str) -> tuple[str, dict]:
    """``"snapkv:window=64,kernel=5"`` → ``("snapkv", {"window": 64, "kernel": 5})``."""
    name, _, rest = spec.partition(":")
    kwargs = {}
    for item in filter(None, rest.split(",")):
        key, eq, val = item.partition("=")
        if not eq or not key:
            raise ValueError(f"bad setting {item!r} in {spec!r}; expected key=value")
        kwargs[key.strip()] = _value(val.strip())
    return name.strip(), kwargs


def _stage_key(spec: str):
    """Specs likely to share prefill statistics (the protocol checks; this only orders the work)."""
    name, kwargs = parse_spec(spec)
    if name in ("snapkv", "pyramidkv"):
        return ("snapkv", kwargs.get("window", 32))
    return "none" if name in ("full", "local") else name


def label(spec: str, budget: float) -> str:
    return f"{spec}@{budget:g}"


def _path(out: Path, side: str, lab: str) -> Path:
    return Path(out) / "nll" / side / (re.sub(r"[^A-Za-z0-9._=@,-]+", "_", lab) + ".pt")


def run_side(
    side: str,
    engine,
    windows: Sequence[Window],
    specs: Sequence[str],
    budgets: Sequence[float],
    out: Path,
    batch_size: int = 4,
    log=print,
    reference_dir: Path | None = None,
) -> None:
    """Measure every ``spec × budget`` (plus the full cache) not yet stored under ``out``.

    With ``reference_dir`` (:class:`~vlkv.eval.continuation.ReferenceLogits`: vlkv's full-cache
    logits per window, written by the vlkv side's full run) every configuration also gets per-token
    KL and top-1 agreement against the full cache; stored results without them are measured again.
    The kvpress side needs the vlkv side's reference first.
    """
    from vlkv.eval.continuation import ReferenceLogits
    from vlkv.runtime.policies import make_policy

    first = ("full" if side == "vlkv" else "none", 1.0)
    todo = [first] + [(s, b) for s in specs for b in budgets]
    meta = {"windows": [w.source for w in windows]}
    reference = ReferenceLogits(reference_dir) if reference_dir is not None else None
    if side == "kvpress" and reference is not None and not reference.has(windows):
        raise ValueError(
            f"no full-cache reference logits under {reference_dir}: run the vlkv side first "
            "(its full cache writes them)"
        )

    def done(spec, b) -> bool:
        path = _path(out, side, label(spec, b))
        if not path.is_file():
            return False
        if reference is None:
            return True
        if side == "vlkv" and spec == "full" and not reference.has(windows):
            return False
        return "kl" in torch.load(path, weights_only=False)

    pending = [(spec, b) for spec, b in todo if not done(spec, b)]
    # vlkv: configurations asking the same prefill statistics run together (one shared prefill);
    # kvpress: one adapter process per configuration, so each is stored as soon as it is measured
    if side == "vlkv":
        stages = [
            [p for p in pending if _stage_key(p[0]) == k]
            for k in dict.fromkeys(_stage_key(p[0]) for p in pending)
        ]
    else:
        stages = [[p] for p in pending]
    for group in stages:
        if side == "vlkv":
            configs = []
            for spec, budget in group:
                name, kwargs = parse_spec(spec)
                policy = make_policy(name) if name == "full" else make_policy(name, budget=budget, **kwargs)
                configs.append((label(spec, budget), policy))
            results = run_protocol(engine, windows, configs, batch_size, reference=reference)
        else:
            from vlkv.eval.peers import peer_continuation_nll

            cfgs = [(label(spec, b), *parse_spec(spec)[:1], b, parse_spec(spec)[1]) for spec, b in group]
            # the exported LM (hundreds of MB) stays out of the results folder
            with tempfile.TemporaryDirectory(prefix="vlkv-realtext-") as work:
                results = peer_continuation_nll(engine, list(windows), cfgs, Path(work), reference=reference)
        for spec, budget in group:
            lab = label(spec, budget)
            res = results[lab]
            res.update(meta, side=side, spec=spec, budget=budget, label=lab)
            path = _path(out, side, lab)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(res, path)
            if "nll" in res:
                extra = (
                    f", KL {float(res['kl'].mean()):.4f}, top-1 {float(res['top1'].double().mean()):.3f}"
                    if "kl" in res
                    else ""
                )
                log(f"{side} {lab}: ppl {ppl(res['nll']):.4f}{extra} ({res.get('seconds', 0):.0f} s)")
            else:
                log(f"{side} {lab}: FAILED {res.get('error')}")


def _load(out: Path) -> list[dict]:
    return [torch.load(p, weights_only=False) for p in sorted((Path(out) / "nll").glob("*/*.pt"))]


def _fmt(point, lo, hi) -> str:
    return f"{100 * point:+.2f}% [{100 * lo:+.2f}, {100 * hi:+.2f}]"


def mean_interval(
    x: torch.Tensor, base: torch.Tensor | None = None, n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float, float]:
    """Mean of ``x (W, T)`` (minus ``base``'s, paired, when given) and its percentile-bootstrap
    interval over windows: for additive per-token metrics (KL, top-1 agreement)."""
    a = x.double().mean(1)
    if base is not None:
        if base.shape != x.shape:
            raise ValueError(
                f"paired metrics must share (W, T), got {tuple(x.shape)} and {tuple(base.shape)}"
            )
        a = a - base.double().mean(1)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, a.shape[0], (n_boot, a.shape[0]), generator=g)
    lo, hi = torch.quantile(
        a[idx].mean(1), torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    )
    return float(a.mean()), float(lo), float(hi)


def _fmt_kl(point, lo, hi) -> str:
    return f"{point:.4f} [{lo:.4f}, {hi:.4f}]"


def report(out: Path, n_boot: int = 2000) -> tuple[str, list[dict]]:
    """Markdown + records: ΔPPL vs vlkv's full cache per configuration, best per side and budget,
    and the paired interval of vlkv-best vs kvpress-best. Every interval is a paired percentile
    bootstrap over windows (95 %)."""
    runs = _load(out)
    full = next((r for r in runs if r["side"] == "vlkv" and r["spec"] == "full"), None)
    if full is None:
        raise ValueError(f"no vlkv full-cache run under {out}")
    base = full["nll"]
    records = []
    for r in runs:
        rec = {k: r[k] for k in ("side", "spec", "budget", "label") if k in r}
        if "nll" not in r:
            rec["error"] = r.get("error", "")
            records.append(rec)
            continue
        if r["nll"].shape != base.shape or r.get("windows") != full.get("windows"):
            raise ValueError(f"{r['label']} was measured on other windows than the full cache")
        point, lo, hi = paired_delta(r["nll"], base, n_boot)
        rec.update(ppl=ppl(r["nll"]), dppl=point, dppl_lo=lo, dppl_hi=hi)
        if "kl" in r:
            rec["kl"], rec["kl_lo"], rec["kl_hi"] = mean_interval(r["kl"], n_boot=n_boot)
            rec["top1"] = float(r["top1"].double().mean())
        for key in ("kv_bytes", "full_kv_bytes", "meta_bytes", "peak_kv_bytes", "seconds"):
            if key in r:
                rec[key] = r[key]
        if "kept_per_layer" in r:  # kvpress reports entries kept per layer, not bytes
            rec["kept_fraction"] = sum(r["kept_per_layer"]) / len(r["kept_per_layer"]) / r["prompt_length"]
        records.append(rec)
    by_label = {(r["side"], r["label"]): r for r in runs if "nll" in r}
    budgets = sorted({r["budget"] for r in records if r["budget"] < 1}, reverse=True)
    w, t = base.shape
    lines = [
        f"Full cache (vlkv): PPL {ppl(base):.4f} over {w} windows x {t} tokens.",
        "",
        f"| side | configuration | budget | PPL | ΔPPL vs full [95% CI] | vs vlkv `{REFERENCE}` [95% CI] "
        "| KL(full ‖ config) [95% CI] | top-1 agreement | KV bytes / full | metadata bytes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rec in sorted(records, key=lambda r: (-r["budget"], r["side"], r.get("dppl", math.inf))):
        if "error" in rec:
            lines.append(
                f"| {rec['side']} | `{rec['spec']}` | {rec['budget']:g} | failed: {rec['error']} | | | | | | |"
            )
            continue
        ratio = (
            f"{rec['kv_bytes'] / rec['full_kv_bytes']:.3f}"
            if "kv_bytes" in rec
            else f"{rec['kept_fraction']:.3f} (entries)"
            if "kept_fraction" in rec
            else ""
        )
        meta = f"{rec['meta_bytes'] / w:,.0f}/window" if "meta_bytes" in rec else ""
        kl = _fmt_kl(rec["kl"], rec["kl_lo"], rec["kl_hi"]) if "kl" in rec else ""
        top1 = f"{rec['top1']:.3f}" if "top1" in rec else ""
        ref = by_label.get(("vlkv", label(REFERENCE, rec["budget"])))
        vs = ""
        if ref is not None and rec["budget"] < 1:
            point, lo, hi = paired_delta(by_label[(rec["side"], rec["label"])]["nll"], ref["nll"], n_boot)
            rec.update(vs_reference=point, vs_reference_lo=lo, vs_reference_hi=hi)
            vs = _fmt(point, lo, hi)
        lines.append(
            f"| {rec['side']} | `{rec['spec']}` | {rec['budget']:g} | {rec['ppl']:.4f} | "
            f"{_fmt(rec['dppl'], rec['dppl_lo'], rec['dppl_hi'])} | {vs} | {kl} | {top1} | {ratio} | {meta} |"
        )
    lines += [
        "",
        "Best per side and budget (lowest PPL), and vlkv-best vs kvpress-best: "
        "PPL(vlkv best) / PPL(kvpress best) − 1, paired over windows (negative = vlkv better).",
        "",
        "| budget | vlkv best | ΔPPL vs full | kvpress best | ΔPPL vs full | vlkv − kvpress [95% CI] "
        "| KL: vlkv − kvpress [95% CI] | top-1: vlkv − kvpress [95% CI] |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for b in budgets:
        best = {}
        for side in ("vlkv", "kvpress"):
            cands = [r for r in records if r["side"] == side and r["budget"] == b and "dppl" in r]
            if cands:
                best[side] = min(cands, key=lambda r: (r["ppl"], len(r["spec"])))  # ties: simpler spec
        if len(best) < 2:
            continue
        v, k = best["vlkv"], best["kvpress"]
        point, lo, hi = paired_delta(
            by_label[("vlkv", v["label"])]["nll"], by_label[("kvpress", k["label"])]["nll"], n_boot
        )
        rec = {
            "side": "compare",
            "budget": b,
            "vlkv": v["spec"],
            "kvpress": k["spec"],
            "delta": point,
            "lo": lo,
            "hi": hi,
        }
        rv, rk = by_label[("vlkv", v["label"])], by_label[("kvpress", k["label"])]
        kl_cell = top1_cell = ""
        if "kl" in rv and "kl" in rk:
            rec["kl_delta"], rec["kl_lo"], rec["kl_hi"] = mean_interval(rv["kl"], rk["kl"], n_boot)
            rec["top1_delta"], rec["top1_lo"], rec["top1_hi"] = mean_interval(rv["top1"], rk["top1"], n_boot)
            kl_cell = f"{rec['kl_delta']:+.4f} [{rec['kl_lo']:+.4f}, {rec['kl_hi']:+.4f}]"
            top1_cell = f"{rec['top1_delta']:+.3f} [{rec['top1_lo']:+.3f}, {rec['top1_hi']:+.3f}]"
        records.append(rec)
        lines.append(
            f"| {b:g} | `{v['spec']}` | {100 * v['dppl']:+.2f}% | `{k['spec']}` | {100 * k['dppl']:+.2f}% | "
            f"{_fmt(point, lo, hi)} | {kl_cell} | {top1_cell} |"
        )
    lines += [
        "",
        "Matched implementations (same method, same settings): PPL(vlkv) / PPL(kvpress) − 1, paired.",
        "",
        "| vlkv | kvpress | budget | vlkv − kvpress [95% CI] |",
        "|---|---|---|---|",
    ]
    for v_spec, k_spec in MATCHED:
        for b in budgets:
            v, k = by_label.get(("vlkv", label(v_spec, b))), by_label.get(("kvpress", label(k_spec, b)))
            if v is None or k is None:
                continue
            point, lo, hi = paired_delta(v["nll"], k["nll"], n_boot)
            records.append(
                {
                    "side": "matched",
                    "budget": b,
                    "vlkv": v_spec,
                    "kvpress": k_spec,
                    "delta": point,
                    "lo": lo,
                    "hi": hi,
                }
            )
            lines.append(f"| `{v_spec}` | `{k_spec}` | {b:g} | {_fmt(point, lo, hi)} |")
    return "\n".join(lines) + "\n", records


def write_report(out: Path, header: str = "", n_boot: int = 2000) -> Path:
    """``results.md`` and ``results.json`` next to the stored runs under ``out``."""
    md, records = report(out, n_boot)
    (Path(out) / "results.md").write_text(header + md)
    (Path(out) / "results.json").write_text(json.dumps(records, indent=1) + "\n")
    # the raw data every number above is computed from (equal-length windows: a window's mean NLL
    # carries all that PPL and the paired bootstrap use); the .pt files stay local
    runs = [r for r in _load(out) if "nll" in r]
    raw = {
        "windows": runs[0]["windows"] if runs else [],
        "tokens_per_window": int(runs[0]["nll"].shape[1]) if runs else 0,
        "window_mean_nll": {
            f"{r['side']}:{r['label']}": [round(float(x), 7) for x in r["nll"].double().mean(1)] for r in runs
        },
        "window_mean_kl": {
            f"{r['side']}:{r['label']}": [round(float(x), 8) for x in r["kl"].double().mean(1)]
            for r in runs
            if "kl" in r
        },
        "window_top1": {
            f"{r['side']}:{r['label']}": [round(float(x), 6) for x in r["top1"].double().mean(1)]
            for r in runs
            if "top1" in r
        },
    }
    (Path(out) / "per_window.json").write_text(json.dumps(raw, indent=1) + "\n")
    plot_dppl(records, Path(out) / "dppl.png")
    return Path(out) / "results.md"


# the lines the ΔPPL plot draws when measured: each side's query-agnostic and best classic configurations
PLOTTED = (
    ("vlkv", "kvgrad:heads=adaptive"),
    ("vlkv", "kvzip:heads=adaptive"),
    ("vlkv", "kvzip:heads=own"),
    ("vlkv", "h2o"),
    ("vlkv", "snapkv:window=64,kernel=5"),
    ("kvpress", "kvgrad"),
    ("kvpress", "kvzip"),
    ("kvpress", "snapkv:window_size=64,kernel_size=5"),
)


def plot_dppl(records: list[dict], path: Path) -> Path | None:
    """ΔPPL vs budget with the 95 % intervals, one line per :data:`PLOTTED` configuration measured
    (vlkv solid, kvpress dashed); None when none was."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lines = {}
    for side, spec in PLOTTED:
        pts = sorted(
            (r["budget"], r["dppl"], r["dppl_lo"], r["dppl_hi"])
            for r in records
            if r.get("side") == side and r.get("spec") == spec and "dppl" in r and r["budget"] < 1
        )
        if pts:
            lines[(side, spec)] = pts
    if not lines:
        return None
    fig = Figure(figsize=(7, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for (side, spec), pts in lines.items():
        b, d, lo, hi = (list(x) for x in zip(*pts))
        err = [[100 * (y - lo_) for y, lo_ in zip(d, lo)], [100 * (hi_ - y) for y, hi_ in zip(d, hi)]]
        ax.errorbar(
            b,
            [100 * y for y in d],
            yerr=err,
            marker="o",
            capsize=3,
            linestyle="-" if side == "vlkv" else "--",
            label=f"{side} {spec}",
        )
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(sorted({p[0] for pts in lines.values() for p in pts}))
    ax.get_xaxis().set_major_formatter(lambda x, _: f"{x:g}")
    ax.set_xlabel("budget (kept fraction)")
    ax.set_ylabel("ΔPPL vs full cache (%)")
    ax.set_title("Continuation perplexity change, paired 95% intervals")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path)
    return path
