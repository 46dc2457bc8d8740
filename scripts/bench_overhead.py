"""vlkv's full-cache generation against transformers' own ``generate`` on the same weights, one run.

    python scripts/bench_overhead.py --model smollm2-llava --tokens 512 --batch 1 4 --new 32

Both sides get the same token ids (a text prompt of about ``--tokens`` tokens, repeated ``--batch``
times so no row is padded), the same dtype, thread count and attention kernel (transformers runs
its ``sdpa`` implementation on a second copy of the weights; vlkv calls SDPA from its own attention
function). Greedy, no early stop. Each repeat runs, interleaved, transformers then vlkv for
``--new + 1`` tokens and stamps the clock as each step's tokens come out (transformers: a stopping
criterion, which ``generate`` calls once per step; vlkv: the request's ``on_token`` callback, the
batch's last token of the step). Prefill = start to the first token; decode step = first to last
token over ``--new``, so the loop's own per-step work counts on both sides and a noisy prefill
does not leak into the step time. Ratios are vlkv speed / transformers speed (> 1: vlkv is faster),
median over repeats of the per-repeat ratio. ``--profile`` adds a cProfile of vlkv's generation.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

from vlkv.runtime.engine import Engine
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    add_device_args,
    add_threads_arg,
    check_device_args,
    load_for_bench,
    machine_name,
    sync,
)  # noqa: E402


def text_of_length(engine: Engine, tokens: int) -> Prompt:
    """A text-only prompt of about ``tokens`` tokens (corpus prose, scaled in a few passes)."""
    from vlkv.eval.corpus import paragraphs

    corpus = " ".join(paragraphs()).split()
    corpus = corpus * (2 * tokens // len(corpus) + 1)  # long prompts repeat the corpus (~2k tokens once)
    words = max(tokens // 2, 1)
    prompt = Prompt("")
    for _ in range(4):
        prompt = Prompt(" ".join(corpus[:words]), raw=True)
        n = int(engine.encode([prompt]).lengths[0])
        if abs(n - tokens) <= 4:
            break
        words = max(1, round(words * tokens / n))
    return prompt


class _Stamps:
    """Wall-clock time at which each step's last token came out, for one generation."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.steps: list[float] = []

    def prefill_s(self) -> float:
        return self.steps[0] - self.start

    def step_s(self) -> float:
        return (self.steps[-1] - self.steps[0]) / (len(self.steps) - 1)


class _HFStamp:
    """A stopping criterion that never stops: ``generate`` calls it once per step, after the step's
    tokens are appended."""

    def __init__(self, stamps: _Stamps) -> None:
        self.stamps = stamps

    def __call__(self, input_ids, scores, **kwargs):
        self.stamps.steps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def hf_generate(
    model, ids: torch.Tensor, new: int, stamps: _Stamps | None = None, cache: str = "dynamic"
) -> torch.Tensor:
    """transformers' greedy ``generate`` for ``ids (B, T)``, exactly ``new`` tokens → ``(B, new)``;
    ``cache``: ``dynamic`` (``DynamicCache``, its default) or ``static`` (pre-allocated)."""
    from transformers import StoppingCriteriaList

    extra = {"cache_implementation": "static"} if cache == "static" else {}
    out = model.generate(
        **extra,
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        stopping_criteria=StoppingCriteriaList([_HFStamp(stamps)] if stamps else []),
    )
    return out[:, ids.shape[1] :]


def vlkv_generate(engine: Engine, prompts: list[Prompt], new: int, stamps: _Stamps | None = None):
    """vlkv's greedy full-cache generation through its scheduler → list of ``new`` token ids per prompt."""
    from vlkv.runtime.request import Request, Status
    from vlkv.runtime.sampling import Sampler
    from vlkv.runtime.scheduler import Scheduler

    emitted = [0]

    def on_token(req, token):
        emitted[0] += 1
        if stamps is not None and emitted[0] % len(prompts) == 0:  # the step's last request
            stamps.steps.append(time.perf_counter())

    sched = Scheduler(engine)
    full = make_policy("full")
    reqs = [
        sched.submit(Request(p, full, new, Sampler(), stop_at_eos=False, on_token=on_token)) for p in prompts
    ]
    sched.run()
    for r in reqs:
        if r.status is not Status.FINISHED:
            raise RuntimeError(f"vlkv request ended {r.status}: {r.error}")
    return [list(r.tokens) for r in reqs]


def run(args) -> dict:
    engine = Engine(load_for_bench(args.model, args.device, args.dtype))
    peer = load_for_bench(args.model, args.device, args.dtype).model
    peer.config._attn_implementation = "sdpa"
    peer.config.get_text_config()._attn_implementation = "sdpa"
    prompt = text_of_length(engine, args.tokens)
    rows = []
    for b in args.batch:
        prompts = [prompt] * b
        ids = engine.encode(prompts).input_ids.to(args.device)
        # same tokens on both sides, or the comparison times different work
        a = torch.tensor(vlkv_generate(engine, prompts, args.new + 1))
        peers = {("hf" if c == "dynamic" else f"hf_{c}"): c for c in args.peer_cache}
        same = all(
            bool((a == hf_generate(peer, ids, args.new + 1, cache=c).cpu()).all()) for c in peers.values()
        )
        pre = {name: [] for name in (*peers, "vlkv")}
        step = {name: [] for name in (*peers, "vlkv")}
        for _ in range(args.repeats):
            for name in (*peers, "vlkv"):
                sync(args.device)
                stamps = _Stamps()
                if name in peers:
                    hf_generate(peer, ids, args.new + 1, stamps, cache=peers[name])
                else:
                    vlkv_generate(engine, prompts, args.new + 1, stamps)
                sync(args.device)
                if len(stamps.steps) != args.new + 1:
                    raise RuntimeError(f"{name}: {len(stamps.steps)} step stamps, expected {args.new + 1}")
                pre[name].append(stamps.prefill_s())
                step[name].append(stamps.step_s())

        def speed(times: dict, name: str) -> float:
            return statistics.median(h / o for h, o in zip(times[name], times["vlkv"]))

        # the strongest peer configuration: the faster transformers cache for this shape
        best = min(peers, key=lambda n: statistics.median(step[n]))
        rows.append(
            {
                "batch": b,
                "prompt_tokens": int(ids.shape[1]),
                "same_tokens": same,
                "prefill_s": {k: statistics.median(v) for k, v in pre.items()},
                "decode_step_s": {k: statistics.median(v) for k, v in step.items()},
                "prefill_speed_ratio": speed(pre, best),
                "decode_speed_ratio": speed(step, best),
                "fastest_peer": best,
                "decode_speed_vs": {name: speed(step, name) for name in peers},
            }
        )
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            vlkv_generate(engine, prompts, args.new + 1)
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            print(buf.getvalue())
    return {
        "machine": machine_name(args.device),
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "new_tokens": args.new,
        "repeats": args.repeats,
        "rows": rows,
    }


def to_markdown(res: dict) -> str:
    lines = [
        f"vlkv full cache vs transformers `generate` ({res['dtype']}, {res['machine']}, "
        f"{res['new_tokens']} new tokens, median of {res['repeats']} interleaved repeats)",
        "",
        "| batch | prompt tokens | same tokens | prefill vlkv / hf (s) | speed vs hf | decode step vlkv / hf (ms) | speed vs hf |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        p, d, hf = r["prefill_s"], r["decode_step_s"], r.get("fastest_peer", "hf")
        lines.append(
            f"| {r['batch']} | {r['prompt_tokens']} | {'yes' if r['same_tokens'] else 'NO'} "
            f"| {p['vlkv']:.3f} / {p[hf]:.3f} | {r['prefill_speed_ratio']:.2f}× "
            f"| {1e3 * d['vlkv']:.1f} / {1e3 * d[hf]:.1f} ({hf}) | {r['decode_speed_ratio']:.2f}× |"
        )
        for name, ratio in r.get("decode_speed_vs", {}).items():
            lines.append(f"|  |  |  |  |  | vs {name}: {1e3 * d[name]:.1f} ms | {ratio:.2f}× |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-llava")
    ap.add_argument("--tokens", type=int, default=512, help="prompt length to aim for")
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--new", type=int, default=32, help="decode steps timed")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--peer-cache",
        nargs="+",
        choices=["dynamic", "static"],
        default=["dynamic"],
        help="transformers cache(s) to time, interleaved; ratios are against the fastest",
    )
    ap.add_argument("--profile", action="store_true", help="print a cProfile of vlkv's generation")
    ap.add_argument("--json", default=None, help="write the results here")
    add_device_args(ap)
    add_threads_arg(ap)
    args = ap.parse_args()
    check_device_args(ap, args)
    if args.new < 1 or args.tokens < 1 or min(args.batch) < 1:
        ap.error("--new, --tokens and --batch must be >= 1")
    res = run(args)
    print(to_markdown(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
