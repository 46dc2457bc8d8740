"""Where a query-agnostic compression's time goes: stage × op kind, one profiled run per configuration.

    python scripts/bench_replay_profile.py --configs "kvgrad:replay_dtype=bfloat16" kvzip --out profile.md

Each configuration compresses one KJV window of ``--tokens`` at budget 0.25 (``Engine.prefill``) under
``torch.profiler``; every ATen op's self time goes to the innermost stage it started in: ``prefill``
(the model step), ``replay-forward`` / ``replay-backward`` (the decoder layers' linear parts, norms,
MLPs: the replay outside its attention core), ``attn-core-forward`` / ``attn-core-backward`` (KVgrad's
replay attention, :mod:`vlkv.runtime.replay_grad`, whose backward also takes the scores),
``attn-core+scores`` (KVzip's one pass, :func:`~vlkv.runtime.replay_fast.attend_and_score`),
``scores`` (a separate score pass: the reference's), ``col-weight`` (``‖W_O v‖``), ``edit``. The
stages are found by wrapping the functions that run them (a profiling aid, not an API). Ratios to
the profiled run's own ``prefill`` stage are what to compare; absolute times move with the load.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import load_for_bench, machine_name  # noqa: E402


def _stage(label: str, fn):
    from torch.profiler import record_function

    def run(*args, **kwargs):
        with record_function("STAGE:" + label):
            return fn(*args, **kwargs)

    return run


def _instrument(engine) -> None:
    import vlkv.runtime.engine as eng
    import vlkv.runtime.replay as rep
    import vlkv.runtime.replay_grad as grad

    engine.backend.step = _stage("prefill", engine.backend.step)
    rep._run_layers = _stage("replay-forward", rep._run_layers)
    torch.autograd.grad = _stage("replay-backward", torch.autograd.grad)
    rep.scores_from_lse = _stage("scores", rep.scores_from_lse)
    rep.replay_attention_max = _stage("scores", rep.replay_attention_max)
    rep.attend_and_score = _stage("attn-core+scores", rep.attend_and_score)
    grad.value_output_norm = _stage("col-weight", grad.value_output_norm)
    eng._edits.apply_edits = _stage("edit", eng._edits.apply_edits)
    fn = grad._ReplayAttention
    fn.forward = staticmethod(_stage("attn-core-forward", fn.forward))
    fn.backward = staticmethod(_stage("attn-core-backward", fn.backward))


def profile_one(engine, window, spec: str) -> dict[str, collections.Counter]:
    """Self time (s) per stage and op of one compression; ``"prefill"`` included."""
    from bench_scoring_cost import measure
    from torch.profiler import ProfilerActivity, profile

    measure(engine, [window], spec, "cpu")  # warm-up (the bf16 copy of the layers, first-call costs)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        measure(engine, [window], spec, "cpu")
    events = list(prof.events())
    stages = [e for e in events if e.name.startswith("STAGE:")]
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        inner = [s for s in stages if s.time_range.start <= e.time_range.start <= s.time_range.end]
        stage = min(inner, key=lambda s: s.time_range.elapsed_us()).name[6:] if inner else "other"
        out[stage][e.name[6:]] += e.self_cpu_time_total / 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-llava")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--configs", nargs="+", required=True)
    ap.add_argument("--top", type=int, default=4, help="op kinds listed per stage")
    ap.add_argument("--out", type=Path, default=None, help="also write the tables here (markdown)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from bench_scoring_cost import _windows

    from vlkv.runtime.engine import Engine

    engine = Engine(load_for_bench(args.model, "cpu", "fp32"))
    window = _windows(engine, args.tokens, 1)[0]
    _instrument(engine)
    lines = [
        f"Compression profile ({args.model}, fp32 model, 1 thread, {machine_name('cpu')}; {args.tokens} tokens)"
    ]
    for spec in args.configs:
        stages = profile_one(engine, window, spec)
        prefill = sum(stages["prefill"].values())
        total = sum(sum(c.values()) for c in stages.values())
        lines += [
            "",
            f"`{spec}`: {total:.2f} s profiled, {total / prefill:.2f}× its prefill",
            "",
            "| stage | s | × prefill | top op kinds (s) |",
            "|---|---:|---:|---|",
        ]
        for stage, ops in sorted(stages.items(), key=lambda kv: -sum(kv[1].values())):
            t = sum(ops.values())
            top = ", ".join(f"{k} {v:.2f}" for k, v in ops.most_common(args.top))
            lines.append(f"| {stage} | {t:.2f} | {t / prefill:.2f} | {top} |")
    text = "\n".join(lines) + "\n"
    if args.out is not None:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
