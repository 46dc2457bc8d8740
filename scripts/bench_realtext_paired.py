"""Pair a real-text run with an earlier run's stored per-window results on the same windows.

    python scripts/bench_realtext_paired.py --out docs/benchmarks/<this run>/realtext \
        --stored docs/benchmarks/<earlier run>/realtext \
        --series "kvgrad before::stored:vlkv:kvgrad:heads=adaptive" "kvgrad bf16::vlkv:kvgrad:replay_dtype=bfloat16" \
        --compare "kvgrad bf16::kvgrad before" --report paired.md

A real-text run (``scripts/continuation_ppl.py``) stores per-token NLL under ``<out>/nll``; an earlier
run committed only its per-window mean NLL (``per_window.json``) and aggregates (``results.json``).
Window means are all that ΔPPL and its paired bootstrap need (every window has the same number of
tokens), so an earlier run's configurations pair with this run's *when the windows are the same*:
checked by name and by the full cache's per-window mean NLL (equal within 1e-5, else exit 2). This
run's windows may be a subset of the earlier run's (e.g. ``--per-book 1`` against ``--per-book 3``):
the earlier run's values are then taken on those windows only. Without ``--stored`` only this run's
series are tabled.

``--series NAME::KEY``: KEY is ``side:label`` of this run (``vlkv:kvgrad``) or ``stored:side:label``
of the earlier run, without the ``@budget``. ``--compare A::B``: the paired difference of the two
series' ΔPPL in percentage points, ``ΔPPL(A) − ΔPPL(B)``, with its 95 % bootstrap interval.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch


def _this_run(out: Path) -> tuple[list[str], dict[str, list[float]], dict[str, float]]:
    """Windows, ``side:label`` → per-window mean NLL, and ``side:label`` → mean KL, of ``out/nll``."""
    means, kl, windows = {}, {}, None
    for path in sorted((out / "nll").glob("*/*.pt")):
        rec = torch.load(path, weights_only=False)
        if "nll" not in rec:
            continue
        key = f"{rec['side']}:{rec['label']}"
        means[key] = rec["nll"].double().mean(1).tolist()
        if "kl" in rec:
            kl[key] = float(rec["kl"].double().mean())
        windows = windows or rec["windows"]
    return windows or [], means, kl


def _stored(folder: Path) -> tuple[list[str], dict[str, list[float]], dict[str, float]]:
    raw = json.loads((folder / "per_window.json").read_text())
    kl = {}
    results = folder / "results.json"
    if results.is_file():
        for rec in json.loads(results.read_text()):
            if rec.get("kl") is not None:
                kl[f"{rec['side']}:{rec['label']}"] = float(rec["kl"])
    return raw["windows"], raw["window_mean_nll"], kl


def _boot_idx(n: int, n_boot: int) -> torch.Tensor:
    return torch.randint(0, n, (n_boot, n), generator=torch.Generator().manual_seed(0))


def _dppl(nll: torch.Tensor, full: torch.Tensor, idx: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Point ΔPPL and its bootstrap replicates; ``nll``/``full`` ``(W,)`` window means."""
    return math.exp(float(nll.mean() - full.mean())) - 1, torch.exp(nll[idx].mean(1) - full[idx].mean(1)) - 1


def _ci(boots: torch.Tensor) -> tuple[float, float]:
    lo, hi = torch.quantile(boots, torch.tensor([0.025, 0.975], dtype=torch.float64))
    return float(lo), float(hi)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="this run's realtext folder")
    ap.add_argument("--stored", type=Path, default=None, help="an earlier run's realtext folder")
    ap.add_argument(
        "--series", nargs="+", required=True, help="NAME::KEY, KEY = side:label or stored:side:label"
    )
    ap.add_argument("--compare", nargs="*", default=[], help="A::B, two series names")
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.5, 0.25, 0.1])
    ap.add_argument("--boot", type=int, default=2000)
    ap.add_argument("--report", type=Path, default=None, help="write the tables here (markdown)")
    args = ap.parse_args(argv)
    windows, means, kl = _this_run(args.out)
    if not windows:
        ap.exit(2, f"error: no stored NLL under {args.out / 'nll'}\n")
    full = torch.tensor(means["vlkv:full@1"], dtype=torch.float64)
    old_means, old_kl = {}, {}
    if args.stored is not None:
        old_windows, old_means, old_kl = _stored(args.stored)
        names = [w.removeprefix("kjv:") for w in windows]
        old_names = [w.removeprefix("kjv:") for w in old_windows]
        if not set(names) <= set(old_names):
            ap.exit(2, "error: this run's windows are not among the earlier run's; nothing pairs\n")
        pick = [old_names.index(w) for w in names]
        old_means = {k: [v[i] for i in pick] for k, v in old_means.items()}
        if names != old_names:
            old_kl = {}  # the stored KL is a mean over all of its windows: not on these
    old_full = torch.tensor(old_means.get("vlkv:full@1", means["vlkv:full@1"]), dtype=torch.float64)
    if float((full - old_full).abs().max()) > 1e-5:
        ap.exit(
            2, "error: the full cache's per-window NLL differs between the runs (another model or text?)\n"
        )
    series = {}
    for item in args.series:
        name, sep, key = item.partition("::")
        if not sep:
            ap.error(f"--series {item!r}: expected NAME::KEY")
        series[name] = key
    idx = _boot_idx(len(windows), args.boot)

    def lookup(name: str, budget: float):
        key = series[name]
        table, kls = (old_means, old_kl) if key.startswith("stored:") else (means, kl)
        lab = f"{key.removeprefix('stored:')}@{budget:g}"
        if lab not in table:
            return None
        return torch.tensor(table[lab], dtype=torch.float64), kls.get(lab)

    lines = [
        f"{len(windows)} windows; full-cache PPL {math.exp(float(full.mean())):.4f}; ΔPPL [95 % paired "
        f"bootstrap over windows, {args.boot} resamples] (mean KL vs the full cache)",
        "",
        "| configuration | " + " | ".join(f"{b:g}" for b in args.budgets) + " |",
        "|---|" + "---:|" * len(args.budgets),
    ]
    for name in series:
        cells = []
        for b in args.budgets:
            got = lookup(name, b)
            if got is None:
                cells.append("—")
                continue
            point, boots = _dppl(got[0], full, idx)
            lo, hi = _ci(boots)
            k = f" ({got[1]:.4f})" if got[1] is not None else ""
            cells.append(f"{100 * point:+.2f} % [{100 * lo:+.2f}, {100 * hi:+.2f}]{k}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if args.compare:
        lines += [
            "",
            "| ΔPPL(A) − ΔPPL(B), percentage points | " + " | ".join(f"{b:g}" for b in args.budgets) + " |",
        ]
        lines.append("|---|" + "---:|" * len(args.budgets))
        for item in args.compare:
            a, sep, b_name = item.partition("::")
            if not sep or a not in series or b_name not in series:
                ap.error(f"--compare {item!r}: expected A::B, two --series names")
            cells = []
            for b in args.budgets:
                ga, gb = lookup(a, b), lookup(b_name, b)
                if ga is None or gb is None:
                    cells.append("—")
                    continue
                pa, ba = _dppl(ga[0], full, idx)
                pb, bb = _dppl(gb[0], full, idx)
                lo, hi = _ci(ba - bb)
                cells.append(f"{100 * (pa - pb):+.2f} [{100 * lo:+.2f}, {100 * hi:+.2f}]")
            lines.append(f"| `{a}` − `{b_name}` | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    if args.report is not None:
        args.report.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
