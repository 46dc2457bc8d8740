"""``kvzip`` (KVzip, arXiv 2505.23416): keep the entries the model needs to *reconstruct* its context.

After prefill the backend replays "Repeat the previous context:" + the context over the cache
(:mod:`vlkv.runtime.replay`); an entry's score is the largest attention any replay row pays it, per
KV head (max over the GQA group). The scores do not depend on any later question, so a cache
compressed once serves every later question (query-agnostic).

Budgets follow ``docs/policies.md``; how they are spread:

* ``heads="adaptive"`` (the default, KVzip's non-uniform head budgets): the ranking also decides
  how many entries each KV head keeps — over layers × heads × entries with ``scope="model"`` (the
  default), over heads × entries within each layer with ``scope="layer"``. A layer's table is as
  wide as its fullest head; the other heads' extra columns become *holes* (their slots are freed
  and never attended, see :class:`~vlkv.runtime.cache.LayerKV`), so the K/V bytes held are exactly
  the picked entries'. Every head keeps at least one entry. On real text it beats ``heads="own"``
  at every budget (docs/policies.md).
* ``heads="own"``: every KV head of a layer keeps the same number of entries, each head its own
  best ones. With ``scope="model"`` one ranking over every layer × KV head × entry of a sample picks
  the ``L · H_kv · k_b`` best and each layer keeps its share of them (non-uniform layer budgets, mean
  ``k_b``); with ``scope="layer"`` every layer keeps ``k_b`` per KV head.
* ``heads="shared"`` (the head-level variant): the KV heads of a layer keep one common set, ranked
  by their max score: one index per layer instead of one per head.

``sinks`` first entries are always kept. At ``budget = 1`` nothing is replayed or evicted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vlkv.runtime.policies.base import sink_mask
from vlkv.runtime.policies.scorer import ScorePolicy
from vlkv.runtime.replay import ATTN_GRADS, DEFAULT_TEMPLATE, REPLAY_MODES, ReplayRequest
from vlkv.runtime.replay_dtype import AUTO, REPLAY_DTYPES

SCOPES = ("model", "layer")
HEADS = ("own", "shared", "adaptive")


@dataclass
class KVzipPolicy(ScorePolicy):
    """Attributes:
    chunk_size: context tokens per replay chunk, >= 1 (memory O(chunk_size × context)).
    sinks: first entries always kept, >= 0.
    scope: ``"model"`` (non-uniform layer budgets from one ranking) or ``"layer"``.
    heads: ``"own"`` (each KV head its own entries, equal counts), ``"shared"`` (head-level: one set
        per layer) or ``"adaptive"`` (each KV head its own entries *and* its own count).
    every: replay every ``every``-th chunk only, >= 1 (cheaper scoring).
    template: the text replayed before each chunk.
    mode: ``"context"`` (template + context) or ``"prompt"`` (the template alone, e.g. a generic
        image description prompt).
    value_norm: also weight each (query head, entry) score by ``||W_O,h v||`` (KVgrad's input factor,
        no backward pass; KVgrad always has it).
    exact: score with the replay's reference pass (a second softmax per layer) in the model's own
        dtype (unless ``replay_dtype`` names one) with KVgrad's exact gradient: the reference every
        fast setting is tested against; slower.
    replay_dtype: the replay's compute dtype: ``"auto"`` (default: bf16 for a float32 model on
        hardware with native bf16 products — CUDA, x86 ``avx512_bf16``/AMX, Arm ``bf16`` — else the
        model's; the model's with ``exact=True``), ``"model"`` or ``"bfloat16"``/``"float16"``/
        ``"float32"`` (an explicit choice always wins). bf16 ranks within 0.15 pp of fp32 on real text,
        see ``vlkv/runtime/replay_dtype.py`` and ``docs/policies.md``.
    grad_layers: KVgrad only: backward through the top ``grad_layers`` layers (-1 = all, exact).
    attn_grad: KVgrad only: ``"auto"`` (default: ``"values"``, or ``"full"`` with ``exact=True``),
        ``"full"`` (the exact gradient) or ``"values"`` (the backward holds the attention
        probabilities constant: about half the backward's cost, an approximation whose kept sets
        stay >= 90 % of the exact ones; equal or better ΔPPL on real text, see ``docs/policies.md``).
    """

    chunk_size: int = 2048
    sinks: int = 4
    scope: str = "model"
    heads: str = "adaptive"
    every: int = 1
    template: str = DEFAULT_TEMPLATE
    mode: str = "context"
    exact: bool = False
    value_norm: bool = False
    replay_dtype: str = AUTO
    grad_layers: int = -1
    attn_grad: str = AUTO

    name: ClassVar[str] = "kvzip"
    # settings whose entries are kept whatever the budget (checked by settings.check_compresses)
    always_kept: ClassVar[tuple[str, ...]] = ("sinks",)
    gradient: ClassVar[bool] = False
    stats_source: ClassVar[str | None] = "replay"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")
        if self.every < 1:
            raise ValueError(f"every must be >= 1, got {self.every}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {self.scope!r}")
        if self.heads not in HEADS:
            raise ValueError(f"heads must be one of {HEADS}, got {self.heads!r}")
        if self.mode not in REPLAY_MODES:
            raise ValueError(f"mode must be one of {REPLAY_MODES}, got {self.mode!r}")
        if self.replay_dtype not in ("model", AUTO) and self.replay_dtype not in REPLAY_DTYPES:
            raise ValueError(
                f"replay_dtype must be 'auto', 'model' or one of {tuple(REPLAY_DTYPES)}, "
                f"got {self.replay_dtype!r}"
            )
        if self.grad_layers < -1:
            raise ValueError(f"grad_layers must be >= -1 (-1 = all layers), got {self.grad_layers}")
        if self.attn_grad != AUTO and self.attn_grad not in ATTN_GRADS:
            raise ValueError(f"attn_grad must be 'auto' or one of {ATTN_GRADS}, got {self.attn_grad!r}")
        if self.exact and self.attn_grad == "values":
            raise ValueError("attn_grad='values' is an approximation of the fast pass; exact=True has none")
        if self.mode == "prompt" and not self.template.strip():
            raise ValueError("template must not be empty with mode='prompt'")

    def replay_request(self, ctx) -> ReplayRequest | None:
        if self.budget >= 1.0:
            return None
        return ReplayRequest(
            self.template,
            self.chunk_size,
            self.gradient,
            self.mode,
            self.every,
            self.exact,
            self.value_norm,
            "model" if self.exact and self.replay_dtype == AUTO else self.replay_dtype,
            self.grad_layers,
            self.resolved_attn_grad(),
        )

    def resolved_attn_grad(self) -> str:
        """``attn_grad`` with ``"auto"`` resolved: the exact gradient for ``exact=True``, else ``"values"``
        (measured at or below the exact gradient's ΔPPL for about half its backward, #30)."""
        if self.attn_grad != AUTO:
            return self.attn_grad
        return "full" if self.exact or not self.gradient else "values"

    def after_prefill(self, cache, stats, ctx):
        if self.budget >= 1.0 or getattr(stats, "replay", None) is None:
            return None
        return super().after_prefill(cache, stats, ctx)

    def score(self, layer, stats, ctx):
        """``stats``: the layer's replay scores ``(B, H_kv, S)`` (:mod:`vlkv.runtime.replay`); max over
        the KV heads for ``heads="shared"``."""
        score = stats.float()
        return score.amax(1, keepdim=True).expand_as(score) if self.heads == "shared" else score

    def protect(self, layer, width, keep):
        return sink_mask(layer.lengths, width, self.sinks)

    def min_keep(self) -> int:
        return self.sinks + 1

    def head_budgets(self) -> str:
        return "adaptive" if self.heads == "adaptive" else "own"

    def layer_scope(self) -> str:
        return self.scope
