"""Quality and performance sweeps of vlkv policies against the full cache, in one process.

Every ratio in a record is measured side by side in the same run (policy vs full cache on the same
prompts), never against a number from another run.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field

import torch

from vlkv.eval.corpus import image_qa_prompts, paragraphs
from vlkv.eval.teacher_forcing import compare_to_full, full_reference
from vlkv.runtime.backend import StatsRequest, StepInputs
from vlkv.runtime.diagnostics import cache_hit_rate
from vlkv.runtime.engine import Engine
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt


@dataclass
class SweepConfig:
    """What to sweep.

    Attributes:
        policies: policy names (``full`` is always measured as the baseline).
        budgets: kept fractions in (0, 1].
        new_tokens: generated tokens per prompt (quality and decode timing).
        batch_sizes: batch sizes for the speed sweep.
        context_words: prompt text lengths (words of corpus text) for the speed sweep.
        repeats: timing repeats (median reported).
    """

    policies: list[str] = field(default_factory=lambda: ["local", "h2o", "snapkv", "elastic"])
    budgets: list[float] = field(default_factory=lambda: [1.0, 0.5, 0.2, 0.1])
    new_tokens: int = 32
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2])
    context_words: list[int] = field(default_factory=lambda: [16, 128])
    repeats: int = 2
    speed_policies: list[str] | None = None  # None = ``policies``
    speed_budgets: list[float] | None = None  # None = ``budgets``

    def __post_init__(self) -> None:
        for b in self.budgets:
            if not 0 < b <= 1:
                raise ValueError(f"budgets must be in (0, 1], got {b}")
        if self.new_tokens < 2:
            raise ValueError(f"new_tokens must be >= 2, got {self.new_tokens}")
        if self.repeats < 1 or min(self.batch_sizes) < 1 or min(self.context_words) < 1:
            raise ValueError("repeats, batch_sizes and context_words must be >= 1")
        self.speed_policies = self.speed_policies or list(self.policies)
        self.speed_budgets = [b for b in (self.speed_budgets or self.budgets) if b < 1]


def quality_prompts(images: list, n: int) -> list[Prompt]:
    """``n`` prompts cycling over ``images``: a corpus paragraph, then an image and an image question.

    The text gives the language model something it can continue meaningfully even when the
    projector is untrained (``smollm2-llava``), so quality metrics measure the cache, not noise.
    """
    qs, texts = image_qa_prompts(), paragraphs()
    return [
        Prompt(
            f"{texts[i % len(texts)]}\n{qs[i % len(qs)]} Then summarise the text above.",
            [images[i % len(images)]],
        )
        for i in range(n)
    ]


def context_prompt(image, words: int) -> Prompt:
    """An image prompt whose text part has ``words`` words of corpus prose (context-length sweeps)."""
    text = " ".join(" ".join(paragraphs()).split()[:words])
    return Prompt(f"{text}\nSummarise the text above and describe the image.", [image])


def quality_records(engine: Engine, prompts: list[Prompt], cfg: SweepConfig, progress=None) -> list[dict]:
    records = []
    reference = full_reference(engine, prompts, cfg.new_tokens)
    for name in cfg.policies:
        for budget in cfg.budgets:
            policy = make_policy(name, budget=budget)
            rep = compare_to_full(engine, prompts, policy, cfg.new_tokens, reference)
            hits = cache_hit_rate(engine, prompts, policy)
            records.append({"kind": "quality", **rep.as_record(), "cache_hit_rate": sum(hits) / len(hits)})
            if progress:
                progress.update(1)
    return records


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def stats_overhead(engine: Engine, prompts: list[Prompt], repeats: int) -> float:
    """Prefill time with every-row statistics over prefill time without, same batch, same run."""
    batch = engine.encode(prompts)
    emb = engine.backend.embed(batch)

    def run(request):
        cache = engine.new_cache(batch)
        engine.backend.step(
            StepInputs(batch.input_ids, batch.positions, batch.modality, batch.lengths, emb), cache, request
        )

    plain = _median_time(lambda: run(None), repeats)
    with_stats = _median_time(lambda: run(StatsRequest()), repeats)
    return with_stats / plain


def speed_records(engine: Engine, image, cfg: SweepConfig, progress=None) -> list[dict]:
    """Per (batch, context, policy, budget): prefill / decode-step / end-to-end ratios vs full."""
    records = []
    # warm-up: first calls allocate
    engine.generate([context_prompt(image, 8)], make_policy("full"), 2, stop_at_eos=False)
    for bs in cfg.batch_sizes:
        for words in cfg.context_words:
            prompts = [context_prompt(image, words)] * bs
            context = engine.encode(prompts[:1]).lengths.item()
            runs = {}
            for name, budget in [("full", 1.0)] + [
                (p, b) for p in cfg.speed_policies for b in cfg.speed_budgets
            ]:
                policy = make_policy(name) if name == "full" else make_policy(name, budget=budget)
                results = [
                    engine.generate(prompts, policy, cfg.new_tokens, stop_at_eos=False)
                    for _ in range(cfg.repeats)
                ]
                results.sort(key=lambda r: r.prefill_s + r.decode_s)
                runs[(name, budget)] = results[len(results) // 2]
                if progress:
                    progress.update(1)
            full = runs[("full", 1.0)]
            overhead = stats_overhead(engine, prompts, cfg.repeats)
            for (name, budget), r in runs.items():
                e2e = r.prefill_s + r.decode_s
                records.append(
                    {
                        "kind": "speed",
                        "policy": name,
                        "budget": budget,
                        "batch": bs,
                        "context_length": context,
                        "prefill_s": r.prefill_s,
                        "decode_step_ms": 1e3 * r.decode_s / max(r.decode_steps, 1),
                        "tokens_per_s": bs * (r.decode_steps + 1) / e2e,
                        "prefill_ratio": r.prefill_s / full.prefill_s,
                        "decode_ratio": (r.decode_s / max(r.decode_steps, 1))
                        / (full.decode_s / max(full.decode_steps, 1)),
                        "e2e_ratio": e2e / (full.prefill_s + full.decode_s),
                        "peak_kv_ratio": r.peak_kv_bytes / full.peak_kv_bytes,
                        "peak_kv_bytes": r.peak_kv_bytes,
                        "stats_overhead_ratio": overhead,
                        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                    }
                )
    return records
