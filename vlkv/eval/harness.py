"""Quality and performance sweeps of vlkv policies against the full cache, in one process.

Every ratio in a record is measured side by side in the same run (policy vs full cache on the same
prompts), never against a number from another run.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vlkv.eval.corpus import image_qa_prompts, paragraphs
from vlkv.eval.teacher_forcing import compare_to_full, full_reference
from vlkv.runtime.backend import StatsRequest, StepInputs
from vlkv.runtime.diagnostics import cache_hit_rate
from vlkv.runtime.engine import Engine
from vlkv.runtime.policies import Policy, make_policy
from vlkv.runtime.prompt import Prompt

# Named configurations beside plain policy names: A-VL as its paper runs it (Table 3: S45 C30 K3
# P90 T50, i.e. core = 2/3 of the kept vision tokens, refreshed every 3 steps, 90 % of the vision
# hidden states through the prefill filter), scaled to each budget (S = T = budget).
NAMED_CONFIGS: dict[str, tuple[str, dict, dict]] = {
    # label: (policy, fixed fields, fields that are multiples of the budget)
    "avl-paper": ("avl", {"interval": 3, "prefill_keep": 0.9}, {"core": 2 / 3}),
}


def make_config(label: str, budget: float) -> Policy:
    """A policy by name, or by a :data:`NAMED_CONFIGS` label, at ``budget``."""
    if label in NAMED_CONFIGS:
        name, fixed, scaled = NAMED_CONFIGS[label]
        scaled = {} if budget >= 1 else {k: v * budget for k, v in scaled.items()}
        policy = make_policy(name, budget=budget, **fixed, **scaled)
    else:
        policy = make_policy(label) if label == "full" else make_policy(label, budget=budget)
    return policy


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
            policy = make_config(name, budget)
            rep = compare_to_full(engine, prompts, policy, cfg.new_tokens, reference)
            hits = cache_hit_rate(engine, prompts, policy)
            rec = {"kind": "quality", **rep.as_record(), "cache_hit_rate": sum(hits) / len(hits)}
            records.append({**rec, "policy": name, "settings": _settings(policy)})
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


def _settings(policy: Policy) -> str:
    """The policy's fields, ``key=value`` joined by commas (what a row was measured with)."""
    import dataclasses

    names = [f.name for f in dataclasses.fields(policy)] if dataclasses.is_dataclass(policy) else []
    return ",".join(f"{k}={getattr(policy, k)}" for k in names if k != "budget")


@torch.no_grad()
def stats_overhead(
    engine: Engine, prompts: list[Prompt], repeats: int, policy: Policy | None = None
) -> float:
    """Prefill time with ``policy``'s statistics request over prefill time without, same batch, same
    run (the model step only, no policy edit). ``policy=None`` requests every-row statistics."""
    batch = engine.encode(prompts)
    emb = engine.backend.embed(batch)
    request = (
        StatsRequest()
        if policy is None
        else policy.prefill_request(engine.context(batch), batch.input_ids.shape[1])
    )
    if request is None:
        return 1.0

    def run(req):
        cache = engine.new_cache(batch)
        engine.backend.step(
            StepInputs(batch.input_ids, batch.positions, batch.modality, batch.lengths, emb), cache, req
        )

    plain = _median_time(lambda: run(None), repeats)
    with_stats = _median_time(lambda: run(request), repeats)
    return with_stats / plain


@contextlib.contextmanager
def peak_rss():
    """Yields a dict whose ``"mib"`` is set, on exit, to the peak resident memory (MiB) reached
    inside the block: Linux's high-water mark is reset on entry (``/proc/self/clear_refs``).
    ``None`` where that is not possible (not Linux, or not permitted)."""
    out: dict[str, float | None] = {"mib": None}
    try:
        Path("/proc/self/clear_refs").write_text("5")
        ok = True
    except OSError:
        ok = False
    yield out
    if ok:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                out["mib"] = int(line.split()[1]) / 1024


@contextlib.contextmanager
def pre_edit_peak():
    """Yields a dict whose ``"kv_bytes"`` tracks the largest ``cache.kv_bytes()`` seen just before
    any policy edit inside the block (after prefill and after each decode append),
    ``"meta_bytes"`` the per-entry metadata bytes at that moment and ``"held_kv_bytes"`` the
    largest seen right after an edit (what decoding reads).

    The engine samples its ``peak_kv_bytes`` after the edits, which misses what the prefill wrote;
    this wraps the engine's edit step for one untimed run instead of changing the engine.
    """
    import vlkv.runtime.edits as engine_module

    seen = {"kv_bytes": 0, "meta_bytes": 0, "held_kv_bytes": 0}
    original = engine_module.apply_edits

    def probe(cache, edits, spare=0):
        kv = cache.kv_bytes()
        if kv >= seen["kv_bytes"]:
            seen["kv_bytes"], seen["meta_bytes"] = kv, cache.meta_bytes()
        result = original(cache, edits, spare)
        seen["held_kv_bytes"] = max(seen["held_kv_bytes"], cache.kv_bytes())
        return result

    engine_module.apply_edits = probe
    try:
        yield seen
    finally:
        engine_module.apply_edits = original


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
                policy = make_config(name, budget)
                with peak_rss() as rss:
                    results = [
                        engine.generate(prompts, policy, cfg.new_tokens, stop_at_eos=False)
                        for _ in range(cfg.repeats)
                    ]
                # untimed: the K/V held before each edit (the true peak) and the metadata with it
                with pre_edit_peak() as peak:
                    engine.generate(prompts, policy, cfg.new_tokens, stop_at_eos=False)
                results.sort(key=lambda r: r.prefill_s + r.decode_s)
                overhead = stats_overhead(engine, prompts, cfg.repeats, policy)
                runs[(name, budget)] = (results[len(results) // 2], peak, rss["mib"], overhead)
                if progress:
                    progress.update(1)
            full, full_peak = runs[("full", 1.0)][:2]
            for (name, budget), (r, peak, rss_mib, overhead) in runs.items():
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
                        # held after the policy's edits, largest over the run (what decode reads)
                        "held_kv_ratio": peak["held_kv_bytes"] / full_peak["held_kv_bytes"],
                        "held_kv_bytes": peak["held_kv_bytes"],
                        # the true peak: sampled before each edit (the prefill writes every entry)
                        "peak_kv_ratio": peak["kv_bytes"] / full_peak["kv_bytes"],
                        "peak_kv_bytes": peak["kv_bytes"],
                        "meta_bytes": peak["meta_bytes"],
                        "final_kv_bytes": r.kv_bytes,
                        "stats_overhead_ratio": overhead,
                        "max_rss_mib": rss_mib,
                    }
                )
    return records
