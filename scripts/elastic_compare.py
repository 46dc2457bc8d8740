"""Elastic Cache on real text: vlkv's policy beside the authors' algorithm, and beside local / h2o.

Protocol (issue #10 item 4): windows of real English prose (Jane Austen's six novels, shipped by
Debian's ``r-cran-janeaustenr``), each a ``--context``-token prompt (1024) compressed once after
prefill, then ``--steps`` (128) teacher-forced continuation tokens, the policy acting after every
step (Elastic Cache's own ``eval_ppl.py`` loop). Perplexity is pooled over every continuation token
of every window; intervals are a paired bootstrap over windows.

    python scripts/elastic_compare.py --protocol once --windows 12 --out once.json
    python scripts/elastic_compare.py --protocol loop --windows 8 --out loop.json
    python scripts/elastic_compare.py --trace --windows 1   # per-layer, per-step vlkv vs reference
    python scripts/elastic_compare.py --table once.json     # markdown table

Results and conclusions: ``docs/elastic.md`` (raw rows in ``docs/benchmarks/elastic-real-text-*.json``).

Needs the real-weight demo (``bash scripts/install_demo.sh``) and ``apt-get download`` access.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from elastic_reference import run_reference  # noqa: E402

NOVELS = ("emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice", "sensesensibility")
PROTOCOLS = (
    "loop: the authors' eval_ppl.py loop, the policy editing after prefill and after every continuation "
    "token; once: compress after prefill only, continuation in one chunk (vlkv.eval.continuation)"
)
RDB = "usr/lib/R/site-library/janeaustenr/data/Rdata"


# ---------------------------------------------------------------- text
def _r_strings(raw: bytes) -> list[str]:
    """The character vector in one R serialization (XDR, version 3) of a STRSXP."""
    off = 2 + 12  # "X\n", version, writer version, min reader version
    (enc_len,) = struct.unpack(">i", raw[off : off + 4])
    off += 4 + enc_len
    flags, count = struct.unpack(">ii", raw[off : off + 8])
    assert flags & 0xFF == 16, "not a character vector"
    off += 8
    out = []
    for _ in range(count):
        _, n = struct.unpack(">ii", raw[off : off + 8])
        off += 8
        if n < 0:
            out.append("")
            continue
        out.append(raw[off : off + n].decode("utf-8", "replace"))
        off += n
    return out


def austen(cache_dir: Path) -> dict[str, str]:
    """Novel name -> full text (lines joined; blank lines separate paragraphs)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    root = cache_dir / "deb"
    if not (root / f"{RDB}.rdb").is_file():
        subprocess.run(["apt-get", "download", "r-cran-janeaustenr"], cwd=cache_dir, check=True)
        deb = next(cache_dir.glob("r-cran-janeaustenr_*.deb"))
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    index = gzip.decompress((root / f"{RDB}.rdx").read_bytes())
    assert b"emma" in index
    data, texts, off = (root / f"{RDB}.rdb").read_bytes(), [], 0
    while off < len(data):
        z = zlib.decompressobj()
        raw = z.decompress(data[off + 4 :])
        off += 4 + len(data) - off - 4 - len(z.unused_data)
        texts.append("\n".join(_r_strings(raw)))
    return dict(zip(NOVELS, texts))


def windows(tokenizer, texts: dict[str, str], count: int, length: int) -> list[tuple[str, int, torch.Tensor]]:
    """``count`` token windows of ``length``, spread evenly over the novels (front matter skipped)."""
    per = math.ceil(count / len(texts))
    out = []
    for name, text in texts.items():
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
        usable = ids.numel() - 2000 - length
        for i in range(per):
            s = 2000 + (usable * (2 * i + 1)) // (2 * per)
            out.append((name, s, ids[s : s + length]))
    # round-robin over novels so that the first ``count`` windows cover as many novels as possible
    names = list(texts)
    out = sorted(out, key=lambda w: (out.index(w) % per, names.index(w[0])))
    return out[:count]


# ---------------------------------------------------------------- vlkv side
@torch.no_grad()
def run_vlkv(engine, prompt: torch.Tensor, continuation: torch.Tensor, policy, trace: bool = False):
    """vlkv's teacher-forced loop (the same one ``vlkv.eval.teacher_forcing`` runs) over token ids.

    Returns per step ``(nll, logits (V,), per-layer positions or None)``.
    """
    from vlkv.runtime.cache import Modality
    from vlkv.runtime.prompt import EncodedPrompt, Spans, collate

    n = prompt.numel()
    enc = EncodedPrompt(
        prompt,
        torch.arange(n)[:, None],
        torch.full((n,), int(Modality.TEXT), dtype=torch.int8),
        {},
        Spans(n, []),
    )
    batch = collate([enc], engine.pad_id)
    cache = engine.new_cache(batch)
    out = engine.prefill(batch, policy, cache)
    records = []
    for t in range(continuation.numel()):
        if t > 0:
            out = engine.decode(continuation[t - 1 : t], batch, policy, cache, t)
        row = out.logits[0].float()
        nll = float(torch.nn.functional.cross_entropy(row[None], continuation[t : t + 1]))
        pos = None
        if trace:
            pos = [lay.positions[0, 0, : int(lay.lengths[0]), 0].clone() for lay in cache.layers]
        records.append((nll, row, pos))
    return records


# ---------------------------------------------------------------- protocol
def variants(budgets):
    """(label, kind, kwargs) of every configuration measured; kind = vlkv | ref."""
    rows = [("full", "vlkv", {"name": "full"})]
    for b in budgets:
        rows += [
            (f"local@{b}", "vlkv", {"name": "local", "budget": b}),
            (f"h2o@{b}", "vlkv", {"name": "h2o", "budget": b}),
        ]
        for pos in ("original", "compacted"):
            rows.append((f"elastic[{pos}]@{b}", "vlkv", {"name": "elastic", "budget": b, "positions": pos}))
            for quirks in (False, True):
                tag = "code" if quirks else "paper"
                rows.append(
                    (f"ref-{tag}[{pos}]@{b}", "ref", {"ratio": 1 - b, "positions": pos, "quirks": quirks})
                )
    return rows


def default_rows(budgets):
    """The table's rows: the paper-form reference is left out (``--trace`` shows it equals vlkv's)."""
    rows = [r for r in variants(budgets) if not r[0].startswith("ref-paper")]
    return sorted(rows, key=lambda r: r[0].startswith(("local", "h2o")))  # elastic rows first


def bootstrap(nll_by_window: list[list[float]], full: list[list[float]], reps: int = 2000, seed: int = 0):
    """ΔPPL vs full (pooled over tokens) and a paired 95% bootstrap interval over windows."""
    import random

    rng = random.Random(seed)
    w = len(full)

    def delta(idx):
        a = [x for i in idx for x in nll_by_window[i]]
        f = [x for i in idx for x in full[i]]
        return math.exp(sum(a) / len(a) - sum(f) / len(f)) - 1

    point = delta(range(w))
    boots = sorted(delta([rng.randrange(w) for _ in range(w)]) for _ in range(reps))
    return point, boots[int(0.025 * reps)], boots[int(0.975 * reps) - 1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", type=int, default=12)
    ap.add_argument("--protocol", choices=("loop", "once"), default="loop", help=PROTOCOLS)
    ap.add_argument("--corpus", choices=("austen", "kjv"), default="austen")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25, 0.1])
    ap.add_argument("--only", nargs="*", default=None, help="labels to run (prefix match)")
    ap.add_argument("--extra", nargs="*", default=[], help="extra vlkv rows: label=policy,key=value,...")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--resume", action="store_true", help="keep rows already in --out (same protocol)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--trace", action="store_true", help="per-layer/per-step vlkv vs reference check")
    ap.add_argument("--selection", action="store_true", help="what each form keeps, per layer, after prefill")
    ap.add_argument("--text-cache", type=Path, default=Path(tempfile.gettempdir()) / "vlkv-austen")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from vlkv.runtime.engine import Engine
    from vlkv.runtime.models.registry import load_model
    from vlkv.runtime.policies import make_policy

    engine = Engine(load_model("smollm2-llava"))  # the engine installs its own attention on its copy
    ref_model = load_model("smollm2-llava").model  # a second copy, eager HF attention, for the reference
    ref_model.set_attn_implementation("eager")
    if args.corpus == "kjv":
        from vlkv.eval.corpus import kjv_books

        texts = dict(kjv_books())
    else:
        texts = austen(args.text_cache)
    wins = windows(engine.tokenizer, texts, args.windows, args.context + args.steps)
    split = lambda ids: (ids[: args.context], ids[args.context :])  # noqa: E731

    if args.selection:
        selection(ref_model, [split(w[2])[0] for w in wins], args.budgets)
        return
    if args.trace:
        trace(engine, ref_model, [split(w[2]) for w in wins], args.budgets)
        return

    rows = variants(args.budgets) if args.only is not None else default_rows(args.budgets)
    for spec in args.extra:  # label=policy,key:value,... (values parsed as YAML scalars)
        import yaml

        label, _, body = spec.partition("=")
        name, *pairs = body.split(",")
        rows.append(
            (
                label,
                "vlkv",
                {"name": name, **{k: yaml.safe_load(v) for k, v in (p.split(":", 1) for p in pairs)}},
            )
        )
    if args.only is not None:
        extra = {r[0] for r in rows[len(rows) - len(args.extra) :]} if args.extra else set()
        rows = [r for r in rows if r[0] in extra | {"full"} or any(r[0].startswith(o) for o in args.only)]
    results = {
        "protocol": vars(args) | {"out": args.out and Path(args.out).name, "text_cache": None},
        "windows": [],
        "rows": {},
    }
    results["windows"] = [{"novel": n, "start_token": s} for n, s, _ in wins]
    nll = {}
    if args.resume and args.out and args.out.is_file():
        old = json.loads(args.out.read_text())
        assert old["windows"] == results["windows"], "--resume needs the same windows"
        results["rows"] = old["rows"]
        nll = {label: row["nll"] for label, row in old["rows"].items()}
    for label, kind, kw in rows:
        if label in nll:
            continue
        t0 = time.perf_counter()
        per_window = []
        for _, _, ids in wins:
            prompt, cont = split(ids)
            if kind == "vlkv":
                kw2 = dict(kw)
                policy = make_policy(kw2.pop("name"), **kw2)
                if args.protocol == "once":
                    from vlkv.eval.continuation import Window, continuation_nll

                    w = Window("w", tuple(prompt.tolist()), tuple(cont.tolist()))
                    per_window.append(
                        [round(float(x), 5) for x in continuation_nll(engine, [w], policy).nll[0]]
                    )
                    continue
                recs = run_vlkv(engine, prompt, cont, policy)
                per_window.append([round(r[0], 5) for r in recs])
            else:
                recs = run_reference(ref_model, prompt, cont, once=args.protocol == "once", **kw)
                per_window.append([round(r.nll, 5) for r in recs])
        nll[label] = per_window
        flat = [x for w in per_window for x in w]
        row = {"ppl": math.exp(sum(flat) / len(flat)), "seconds": round(time.perf_counter() - t0, 1)}
        if label != "full":
            d, lo, hi = bootstrap(per_window, nll["full"])
            row |= {"delta": d, "lo": lo, "hi": hi}
        results["rows"][label] = row | {"nll": per_window}
        print(
            f"{label:32s} ppl {row['ppl']:8.3f}  "
            + (f"Δ {row['delta']:+8.1%} [{row['lo']:+.1%}, {row['hi']:+.1%}]" if "delta" in row else "")
            + f"  {row['seconds']}s",
            flush=True,
        )
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1))


@torch.no_grad()
def selection(model, prompts, budgets) -> None:
    """Per form (paper / code), averaged over layers and prompts: where the anchors sit, how many
    of the last 64 prompt tokens survive as their own entry, the largest bucket, BOS thrown, and
    the overlap of the two forms' anchor sets."""
    from elastic_reference import ReferenceElastic, _forward

    for b in budgets:
        stats, overlap = {"paper": [], "code": []}, []
        for prompt in prompts:
            n = prompt.numel()
            _, past, attn = _forward(model, prompt, None, torch.arange(n), True)
            plans = {}
            for tag, quirks in (("paper", False), ("code", True)):
                pol = ReferenceElastic(1 - b, quirks=quirks)
                pol(past, n, attn, torch.arange(n))
                plans[tag] = pol.plans
                for plan in pol.plans:
                    a, th, tg = plan["anchors"], plan["thrown"], plan["target"]
                    bucket = torch.bincount(tg, minlength=n).max().item() + 1
                    recent = ((a >= n - 65) & (a < n - 1)).sum().item() / 64
                    stats[tag].append(
                        [a.float().mean().item() / n, recent, bucket, float(bool((th == 0).any()))]
                    )
            for p, c in zip(plans["paper"], plans["code"]):
                overlap.append(
                    len(set(p["anchors"].tolist()) & set(c["anchors"].tolist())) / len(p["anchors"])
                )
        for tag, rows in stats.items():
            m = torch.tensor(rows).mean(0).tolist()
            print(
                f"budget {b} {tag:5s}: mean anchor position {m[0]:.2f}·n, last-64 kept {m[1]:.0%}, "
                f"largest bucket {m[2]:.0f} tokens, BOS merged into an anchor in {m[3]:.0%} of layers",
                flush=True,
            )
        print(
            f"budget {b}: code anchors ∩ paper anchors = {sum(overlap) / len(overlap):.0%} of them",
            flush=True,
        )


def trace(engine, model, pairs, budgets) -> None:
    """vlkv's ``elastic`` against the paper-form reference (``quirks=False``), per layer and step."""
    from vlkv.runtime.policies import make_policy

    for prompt, cont in pairs:
        for b in budgets:
            for pos in ("original", "compacted"):
                ref = run_reference(model, prompt, cont, 1 - b, positions=pos, quirks=False)
                ours = run_vlkv(
                    engine, prompt, cont, make_policy("elastic", budget=b, positions=pos), trace=True
                )
                same_layers = [
                    sum(torch.equal(a, r) for a, r in zip(o[2], rr.layer_pos)) for o, rr in zip(ours, ref)
                ]
                dlogit = max(float((o[1] - rr.logits).abs().max()) for o, rr in zip(ours, ref))
                dnll = max(abs(o[0] - rr.nll) for o, rr in zip(ours, ref))
                first_bad = next((t for t, s in enumerate(same_layers) if s != len(ref[0].layer_pos)), None)
                print(
                    f"budget {b} {pos:9s}: layers with identical kept positions, step 0: {same_layers[0]}/"
                    f"{len(ref[0].layer_pos)}, all steps: {min(same_layers)}; first differing step {first_bad}; "
                    f"max |Δlogit| {dlogit:.2e}, max |ΔNLL| {dnll:.2e}",
                    flush=True,
                )


def table(paths: list[Path]) -> str:
    """A markdown table (ΔPPL vs full, 95% interval) of one or more result files on the same windows."""
    rows, windows = {}, None
    for path in paths:
        d = json.loads(Path(path).read_text())
        assert windows in (None, d["windows"]), f"{path}: different windows"
        windows = d["windows"]
        rows |= d["rows"]
    full = rows.pop("full")
    budgets = sorted({label.rsplit("@", 1)[1] for label in rows}, key=float, reverse=True)
    names = list(dict.fromkeys(label.rsplit("@", 1)[0] for label in rows))
    out = [f"full-cache PPL {full['ppl']:.2f} over {len(windows)} windows", ""]
    out.append("| policy | " + " | ".join(f"budget {b}" for b in budgets) + " |")
    out.append("|---|" + "---|" * len(budgets))
    for name in names:
        cells = []
        for b in budgets:
            r = rows.get(f"{name}@{b}")
            cells.append(f"{r['delta']:+.1%} [{r['lo']:+.1%}, {r['hi']:+.1%}]" if r else "")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--table"]:
        print(table(sys.argv[2:]))
        sys.exit(0)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
