"""Generation: prefill → policy → decode loop, over any backend, for a batch of prompts."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from vlkv.runtime import edits as _edits  # called through the module: the eval harness probes it
from vlkv.runtime.backend import StepInputs
from vlkv.runtime.cache import KVCache, Modality
from vlkv.runtime.edits import DECODE_SPARE
from vlkv.runtime.kv.pool import KVPool
from vlkv.runtime.kv.reservation import undone_on_failure
from vlkv.runtime.policies import Policy, PolicyContext, make_policy
from vlkv.runtime.prompt import Prompt, PromptBatch, collate, encode_prompt
from vlkv.runtime.results import GenerationResult, KVUsage, SampleResult
from vlkv.runtime.sampling import Sampler

# the text a user writes for one image, per family
PLACEHOLDERS = {"llava": "<image>", "llava_next": "<image>", "qwen2_vl": "<|image_pad|>"}


class Engine:
    """Holds a loaded model and a backend; runs :meth:`generate` for batches of prompts.

    ``decode_graph``: a scheduler's decode steps (full cache, compress-once and statistics policies,
    per-head holes, A-VL's selected attention, linked pre-RoPE entries, AttentionPack's low-rank factors;
    not swapped-out entries: ``static_step.refusal``) replay a CUDA graph of the decode forward per batch
    size, statistics mode and read kind (``runtime/cuda_graph.py``); a fixed pool
    (``Scheduler(pool_bytes=...)``) is needed, other steps stay eager. CUDA and the torch backend only; off
    by default: H200 run 7 timed a full cache (``Scheduler.step()`` 1.57x faster at 8k x 4), the other
    kinds of step are checked for equality on a GPU but not yet passed there."""

    def __init__(self, loaded, backend: str = "torch", decode_graph: bool = False):
        from vlkv.runtime.backends import make_backend

        self.loaded = loaded
        self.backend = make_backend(backend, loaded)
        if decode_graph:
            from vlkv.runtime.cuda_graph import DecodeGraphs, check_device
            from vlkv.runtime.static_step import StaticDecode

            check_device(getattr(self.backend, "device", "cpu"))
            if not hasattr(self.backend, "static"):
                raise ValueError(f"a CUDA-graph decode step needs the torch backend, not {backend!r}")
            self.backend.static = StaticDecode(self.backend, DecodeGraphs(self.backend.device))
        tok = getattr(loaded.processor, "tokenizer", loaded.processor)
        self.tokenizer = tok
        self.eos_ids = _eos_ids(loaded.model, tok)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        self.placeholder = getattr(loaded, "image_placeholder", None) or PLACEHOLDERS[loaded.family]
        self._rope = None

    @property
    def rope(self):
        """The model's rotary embedding for reading pre-RoPE (shared) entries (:class:`Rope`)."""
        if self._rope is None:
            from vlkv.runtime.kv.rope import Rope

            self._rope = Rope(self.backend.adapter)
        return self._rope

    def encode(self, prompts: list[Prompt], process=None) -> PromptBatch:
        """Tokenize and collate ``prompts``; ``process`` replaces the processor call (see
        :func:`encode_prompt`; an :class:`~vlkv.runtime.encoder_pool.EncoderPool`'s ``process``)."""
        enc = [
            encode_prompt(
                p,
                self.loaded.processor,
                self.backend.adapter,
                self.loaded.prompt_template,
                self.placeholder,
                process=process,
            )
            for p in prompts
        ]
        return collate(enc, self.pad_id)

    def new_cache(self, batch: PromptBatch, pool: KVPool | None = None) -> KVCache:
        """An empty cache for ``batch`` on ``pool`` (a private growable pool when None)."""
        be = self.backend
        cache = KVCache.empty(
            be.num_layers,
            len(batch.prompts),
            be.num_kv_heads,
            be.head_dim,
            be.pos_dims,
            be.dtype,
            be.device,
            pool=pool,
        )
        if cache.pool.rope is None:
            cache.pool.rope = self.rope
        dev = cache.device
        cache.prompt_lengths = batch.lengths.to(dev).clone()
        cache.next_position = torch.stack([p.positions.max(0).values + 1 for p in batch.prompts]).to(dev)
        return cache

    def context(self, batch: PromptBatch, step: int = 0) -> PolicyContext:
        # on the backend's device, like everything a policy builds from it
        lengths = batch.lengths.to(self.backend.device)
        return PolicyContext(batch.spans, lengths, self.backend.num_heads, self.backend.num_kv_heads, step)

    def prefill(self, batch: PromptBatch, policy: Policy, cache: KVCache, all_logits: bool = False):
        ctx = self.context(batch)
        request = policy.prefill_request(ctx, batch.input_ids.shape[1])
        embeds = self.backend.embed(batch)
        inputs = StepInputs(
            batch.input_ids,
            batch.positions,
            batch.modality,
            batch.lengths,
            embeds,
            all_logits,
            row_filter=policy.prefill_filter(cache, ctx),
        )
        out = self.backend.step(inputs, cache, request)
        out.peak_kv_bytes = cache.kv_bytes()
        out.stats.replay = self.replay(policy, ctx, batch, cache, embeds)
        _edits.apply_edits(cache, policy.after_prefill(cache, out.stats, ctx))
        return out

    def replay(self, policy: Policy, ctx: PolicyContext, batch: PromptBatch, cache: KVCache, embeds=None):
        """The replay statistics a query-agnostic policy asks for after prefill (``replay_request``),
        read from the prefilled cache without changing it; None when the policy asks for none.

        ``embeds``: the prompt's ``(B, T, hidden)`` embeddings when the caller has them already.
        """
        ask = getattr(policy, "replay_request", None)
        request = ask(ctx) if ask is not None else None
        if request is None:
            return None
        ids = self.tokenizer(request.template, add_special_tokens=False)["input_ids"]
        embeds = self.backend.embed(batch) if embeds is None else embeds
        template = torch.tensor(ids, dtype=torch.long, device=embeds.device)
        return self.backend.replay(request, cache, embeds, batch.lengths, template)

    def decode_positions(self, policy: Policy, cache: KVCache) -> Tensor:
        """``(B, 1, P)`` positions of the next token under the policy's position mode."""
        if policy.positions == "original":
            return cache.next_position[:, None]
        # compacted: current cache length, shifted by the M-RoPE offset (0 for 1-D RoPE)
        delta = cache.next_position - cache.processed[:, None]
        return (cache.layers[0].lengths[:, None] + delta)[:, None]

    def decode(
        self,
        tokens: Tensor,
        batch: PromptBatch,
        policy: Policy,
        cache: KVCache,
        step: int,
        usage: KVUsage | None = None,
    ):
        """Run one decode step for ``tokens (B,)`` and let the policy edit the cache."""
        ctx = self.context(batch, step)
        b, dev = tokens.shape[0], cache.device
        inputs = StepInputs(
            tokens[:, None].to(dev),
            self.decode_positions(policy, cache),
            torch.full((b, 1), int(Modality.GENERATED), dtype=torch.int8, device=dev),
            torch.ones(b, dtype=torch.long, device=dev),
            attend=policy.decode_attend(cache, ctx),
        )
        # a layer that fails after lower layers appended: every layer's append taken back
        with undone_on_failure(cache.layers):
            out = self.backend.step(inputs, cache, policy.decode_request(cache, ctx))
        out.peak_kv_bytes = cache.kv_bytes()
        if usage is not None:
            usage.add(cache, out.attended)
        cache.next_position += 1
        _edits.apply_edits(cache, policy.after_decode(cache, out.stats, ctx), spare=DECODE_SPARE)
        return out

    def generate(
        self,
        prompts: list[Prompt],
        policy: Policy,
        max_new_tokens: int = 32,
        sampler: Sampler | None = None,
        cache_hit_rate: bool = False,
        hit_rate_k: int | float | None = None,
        stop_at_eos: bool = True,
        pool_bytes: int | None = None,
        link=None,
        store=None,
        tenant: str = "default",
        link_threshold: float | None = None,
    ) -> GenerationResult:
        """Generate for a batch: every prompt becomes a request of one :class:`Scheduler` run.

        Finished prompts leave the decode batch at once. ``cache_hit_rate`` adds
        ``extras["cache_hit_rate"]`` (VL-Cache's Def. 3.1 per layer, see
        :mod:`vlkv.runtime.diagnostics`; ``hit_rate_k`` as its ``k``), at the cost of one extra
        full-cache prefill per prompt outside the timed region. ``stop_at_eos=False`` runs every
        sample for exactly ``max_new_tokens`` (equal-length references, fixed-step timing).
        ``pool_bytes`` fixes the KV pool's size (admission and preemption as in the scheduler).
        ``link`` (a :class:`~vlkv.runtime.link.linker.LinkSpec`) prefills by linking stored records
        (later prompts reuse the images of earlier ones, and ``store``'s records — a
        :class:`~vlkv.runtime.store.ContextStore` — scoped to ``tenant``); ``extras["store"]`` says what
        was reused.
        With sampling, prompt ``i`` draws from its own generator seeded ``sampler.seed + i``.
        """
        from vlkv.runtime.request import Request, Status
        from vlkv.runtime.scheduler import Scheduler

        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        sampler = sampler or Sampler()
        sched = Scheduler(
            self,
            pool_bytes,
            cache_hit_rate=cache_hit_rate,
            hit_rate_k=hit_rate_k,
            store=store,
            link_threshold=link_threshold,
        )
        requests = [
            sched.submit(
                Request(
                    p,
                    policy,
                    max_new_tokens,
                    replace(sampler, seed=sampler.seed + i),
                    stop_at_eos,
                    link=link,
                    tenant=tenant,
                )
            )
            for i, p in enumerate(prompts)
        ]
        sched.run()
        sched.flush()  # records written back in the background are in the store when generate returns
        for r in requests:
            if r.status is Status.FAILED:
                raise r.exception
        extras: dict = {**_usage_fractions(requests)}
        if link is not None:
            extras["ttft_s"] = [r.ttft_s for r in requests]
            refused = {r.extras["link_refused"] for r in requests if "link_refused" in r.extras}
            if refused:
                extras["link_refused"] = sorted(refused)
            from vlkv.runtime.link.spec import LinkStats

            total = LinkStats()
            for r in requests:
                if r.link_stats is not None:
                    total.add(r.link_stats)
            extras["store"] = {**vars(total), "corrupt": 0, "stale": 0}
            if store is not None:
                st = store.stats.to_dict()
                extras["store"].update(corrupt=st["corrupt"], stale=st["stale"])
        if cache_hit_rate:
            extras["cache_hit_rate"] = _merge_hit_rates([r.extras["cache_hit_rate"] for r in requests])
        samples = [
            SampleResult(
                text=self.tokenizer.decode(r.tokens, skip_special_tokens=True),
                token_ids=list(r.tokens),
                prompt_tokens=r.prompt_tokens,
                kept_per_layer=r.final["kept_per_layer"],
                cached_tokens=r.cached_tokens,
            )
            for r in requests
        ]
        kv = sum(r.final["kv_bytes"] for r in requests)
        return GenerationResult(
            samples=samples,
            policy=policy.name,
            budget=policy.budget,
            kv_bytes=kv,
            kv_bytes_used=kv,
            full_kv_bytes=sum(r.final["full_kv_bytes"] for r in requests),
            peak_kv_bytes=sched.peak_used_bytes,
            prefill_s=sched.prefill_s,
            decode_s=sched.decode_s,
            decode_steps=sched.decode_steps,
            extras=extras,
        )


def _usage_fractions(requests) -> dict[str, float | None]:
    """A-VL's stored / used fractions over every request's decode steps (see :class:`KVUsage`)."""
    u = KVUsage()
    for r in requests:
        u.stored, u.used, u.full = (
            u.stored + r.usage["stored"],
            u.used + r.usage["used"],
            u.full + r.usage["full"],
        )
    return u.fractions()


def _merge_hit_rates(reports: list[dict]) -> dict:
    """Per-request CacheHitRate reports → one report over the batch (samples weigh equally)."""
    per_sample = [row for rep in reports for row in rep["per_sample"]]
    per_layer = torch.tensor(per_sample, dtype=torch.float64).mean(0)
    return {
        "per_layer": per_layer.tolist(),
        "mean": float(per_layer.mean()),
        "per_sample": per_sample,
        "k": reports[0]["k"],
    }


def _eos_ids(model, tokenizer) -> set[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = ids if isinstance(ids, (list, tuple)) else [ids]
    found = {int(i) for i in ids if i is not None}
    if tokenizer.eos_token_id is not None:
        found.add(int(tokenizer.eos_token_id))
    return found


def generate(
    model,
    prompts,
    policy: str | Policy = "full",
    max_new_tokens: int = 32,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    backend: str = "torch",
    cache_hit_rate: bool = False,
    hit_rate_k: int | float | None = None,
    stop_at_eos: bool = True,
    **policy_kwargs,
) -> GenerationResult:
    """Generate for one prompt or a list of prompts under a KV-cache policy.

    Args:
        model: a built-in name (``tiny-llava``…), a local HF directory, a ``LoadedModel`` or an :class:`Engine`.
        prompts: a :class:`Prompt`, a string, or a list of them.
        policy: a registered policy name (``policy_kwargs`` go to it, e.g. ``budget=0.2``) or a policy.
        cache_hit_rate, hit_rate_k, stop_at_eos: see :meth:`Engine.generate`.
    """
    engine = model if isinstance(model, Engine) else Engine(_load(model), backend=backend)
    if isinstance(prompts, (str, Prompt)):
        prompts = [prompts]
    prompts = [Prompt(p) if isinstance(p, str) else p for p in prompts]
    if isinstance(policy, str):
        policy = make_policy(policy, **policy_kwargs)
    sampler = Sampler(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    return engine.generate(
        prompts,
        policy,
        max_new_tokens,
        sampler,
        cache_hit_rate=cache_hit_rate,
        hit_rate_k=hit_rate_k,
        stop_at_eos=stop_at_eos,
    )


def _load(model):
    if isinstance(model, str):
        from vlkv.runtime.models.registry import load_model

        return load_model(model)
    return model
