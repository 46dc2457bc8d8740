"""Tensor/pipeline-parallel sharding of a TensorRT-LLM (≤ 1.2) checkpoint, and its inverse.

A multi-GPU legacy checkpoint is one ``config.json`` whose ``mapping`` names ``world_size``,
``tp_size`` and ``pp_size``, plus ``rank{N}.safetensors`` per rank, ``N = pp_rank · tp_size +
tp_rank`` (TensorRT-LLM's ``Mapping``). The rules (spec: linking-store-serving.md §6):

* column-parallel weights (``mlp.fc``, ``mlp.gate``) split on dim 0; row-parallel ones
  (``attention.dense``, ``mlp.proj``) on dim 1; norms are replicated;
* Q, K and V are split per tp rank on their head dim, then fused per rank into ``attention.qkv``;
  when ``num_kv_heads < tp_size`` each K/V head is copied ``tp / kv_heads`` times first, so every
  rank holds the one K/V head its query heads read (needs ``tp % kv_heads == 0``);
* ``lm_head`` is vocabulary-parallel: zero rows pad the vocabulary to a multiple of ``tp``, then it
  splits on dim 0; ``vocab_embedding`` is whole (``use_parallel_embedding`` is false);
* pipeline stages take consecutive layers, the first ``L mod pp`` stages one extra, renumbered from 0
  inside each rank; only the first stage holds ``vocab_embedding``, only the last ``ln_f``/``lm_head``.

:func:`assemble` inverts :func:`shard` exactly (it also checks that duplicated K/V heads are equal
copies and that padding rows are zero), which is how the tests prove the layout.
"""

from __future__ import annotations

import torch

from vlkv.exporter.errors import StageError

_COLUMN = ("mlp.fc.weight", "mlp.gate.weight")  # split on the output dim
_ROW = ("attention.dense.weight", "mlp.proj.weight")  # split on the input dim
_REPLICATED = ("input_layernorm.weight", "post_layernorm.weight")


def check_mapping(config: dict, tp_size: int, pp_size: int) -> None:
    """Raise :class:`StageError` (one line naming the field) unless the model can be split this way."""
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    layers, inter = config["num_hidden_layers"], config["intermediate_size"]
    if tp_size < 1:
        raise StageError(f"trtllm.tp_size: must be >= 1, got {tp_size}")
    if pp_size < 1:
        raise StageError(f"trtllm.pp_size: must be >= 1, got {pp_size}")
    if heads % tp_size:
        raise StageError(f"trtllm.tp_size: {tp_size} does not divide num_attention_heads={heads}")
    if kv % tp_size and tp_size % kv:
        raise StageError(
            f"trtllm.tp_size: {tp_size} and num_key_value_heads={kv} must divide one another "
            "(K/V heads are split, or copied when there are fewer than tp ranks)"
        )
    if inter % tp_size:
        raise StageError(f"trtllm.tp_size: {tp_size} does not divide intermediate_size={inter}")
    if pp_size > layers:
        raise StageError(f"trtllm.pp_size: {pp_size} pipeline stages for num_hidden_layers={layers}")


def pp_layers(num_layers: int, pp_size: int, pp_rank: int) -> list[int]:
    """The global layer indices pipeline stage ``pp_rank`` holds (first ``L mod pp`` stages hold one extra)."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return list(range(start, start + base + (1 if pp_rank < extra else 0)))


def padded_vocab(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size) * tp_size


def sharded_config(config: dict, tp_size: int, pp_size: int) -> dict:
    """``config`` with its ``mapping`` set for ``tp_size × pp_size`` ranks."""
    check_mapping(config, tp_size, pp_size)
    return {**config, "mapping": {"world_size": tp_size * pp_size, "tp_size": tp_size, "pp_size": pp_size}}


def _mapping(config: dict) -> tuple[int, int]:
    m = config.get("mapping") or {}
    tp, pp = int(m.get("tp_size", 1)), int(m.get("pp_size", 1))
    if int(m.get("world_size", tp * pp)) != tp * pp:
        raise StageError(f"mapping.world_size: {m.get('world_size')} != tp_size × pp_size = {tp * pp}")
    return tp, pp


def _qkv_parts(config: dict, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a fused ``(Hq·d + 2·Hkv·d, ...)`` qkv weight or bias into q, k, v."""
    d = config["head_size"]
    sizes = [
        config["num_attention_heads"] * d,
        config["num_key_value_heads"] * d,
        config["num_key_value_heads"] * d,
    ]
    q, k, v = weight.split(sizes, dim=0)
    return q, k, v


def _kv_for_rank(t: torch.Tensor, kv_heads: int, head: int, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s K or V rows (``(Hkv·d, ...)`` in, ``(max(Hkv/tp, 1)·d, ...)`` out)."""
    if kv_heads >= tp:
        return t.chunk(tp, dim=0)[rank]
    # fewer K/V heads than ranks: rank r serves the query heads of K/V head r // (tp / kv_heads)
    j = rank // (tp // kv_heads)
    return t[j * head : (j + 1) * head]


def shard(config: dict, weights: dict[str, torch.Tensor], tp_size: int, pp_size: int) -> list[dict]:
    """Split single-rank TensorRT-LLM ``weights`` into ``tp_size × pp_size`` rank dicts (index = rank)."""
    check_mapping(config, tp_size, pp_size)
    kv, d = config["num_key_value_heads"], config["head_size"]
    layers = config["num_hidden_layers"]
    vocab = padded_vocab(config["vocab_size"], tp_size)
    lm_head = weights["lm_head.weight"]
    if lm_head.shape[0] < vocab:
        lm_head = torch.cat([lm_head, lm_head.new_zeros(vocab - lm_head.shape[0], lm_head.shape[1])])
    ranks: list[dict] = []
    for pp_rank in range(pp_size):
        mine = pp_layers(layers, pp_size, pp_rank)
        for tp_rank in range(tp_size):
            out: dict[str, torch.Tensor] = {}
            if pp_rank == 0:
                out["transformer.vocab_embedding.weight"] = weights["transformer.vocab_embedding.weight"]
            if pp_rank == pp_size - 1:
                out["transformer.ln_f.weight"] = weights["transformer.ln_f.weight"]
                out["lm_head.weight"] = lm_head.chunk(tp_size, dim=0)[tp_rank]
            for local, i in enumerate(mine):
                src, dst = f"transformer.layers.{i}.", f"transformer.layers.{local}."
                for suffix in ("attention.qkv.weight", "attention.qkv.bias"):
                    if src + suffix not in weights:
                        continue
                    q, k, v = _qkv_parts(config, weights[src + suffix])
                    parts = [q.chunk(tp_size, dim=0)[tp_rank]]
                    parts += [_kv_for_rank(t, kv, d, tp_size, tp_rank) for t in (k, v)]
                    out[dst + suffix] = torch.cat(parts, dim=0)
                for name in _COLUMN:
                    out[dst + name] = weights[src + name].chunk(tp_size, dim=0)[tp_rank]
                for name in _ROW:
                    out[dst + name] = weights[src + name].chunk(tp_size, dim=1)[tp_rank]
                for name in _REPLICATED:
                    out[dst + name] = weights[src + name]
            # safetensors needs each tensor to own its storage
            ranks.append({name: t.contiguous().clone() for name, t in out.items()})
    return ranks


def _same(name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    first = tensors[0]
    for t in tensors[1:]:
        if t.shape != first.shape or not torch.equal(t, first):
            raise StageError(f"{name}: replicated copies differ between tensor-parallel ranks")
    return first


def assemble(config: dict, ranks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The single-rank weights ``ranks`` (from :func:`shard` or ``rank{N}.safetensors``) were split from."""
    tp, pp = _mapping(config)
    if len(ranks) != tp * pp:
        raise StageError(f"mapping: {tp} × {pp} ranks expected, got {len(ranks)} rank files")
    kv, d = config["num_key_value_heads"], config["head_size"]
    layers, vocab = config["num_hidden_layers"], config["vocab_size"]

    def row(pp_rank: int) -> list[dict]:
        return ranks[pp_rank * tp : (pp_rank + 1) * tp]

    first, last = row(0), row(pp - 1)
    out = {
        "transformer.vocab_embedding.weight": _same(
            "transformer.vocab_embedding.weight", [r["transformer.vocab_embedding.weight"] for r in first]
        ),
        "transformer.ln_f.weight": _same(
            "transformer.ln_f.weight", [r["transformer.ln_f.weight"] for r in last]
        ),
    }
    lm_head = torch.cat([r["lm_head.weight"] for r in last], dim=0)
    if bool(lm_head[vocab:].any()):
        raise StageError("lm_head.weight: vocabulary padding rows are not zero")
    out["lm_head.weight"] = lm_head[:vocab]
    for pp_rank in range(pp):
        group = row(pp_rank)
        for local, i in enumerate(pp_layers(layers, pp, pp_rank)):
            src, dst = f"transformer.layers.{local}.", f"transformer.layers.{i}."
            for suffix in ("attention.qkv.weight", "attention.qkv.bias"):
                if src + suffix not in group[0]:
                    continue
                q_rows = config["num_attention_heads"] * d // tp
                local_kv = max(kv // tp, 1) * d
                split = [r[src + suffix].split([q_rows, local_kv, local_kv], dim=0) for r in group]
                q = torch.cat([s[0] for s in split], dim=0)
                k_v = []
                for part in (1, 2):
                    pieces = [s[part] for s in split]
                    if kv >= tp:
                        k_v.append(torch.cat(pieces, dim=0))
                    else:  # each K/V head was copied to tp / kv consecutive ranks
                        copies = tp // kv
                        heads = [
                            _same(dst + suffix, pieces[j * copies : (j + 1) * copies]) for j in range(kv)
                        ]
                        k_v.append(torch.cat(heads, dim=0))
                out[dst + suffix] = torch.cat([q, *k_v], dim=0)
            for name in _COLUMN:
                out[dst + name] = torch.cat([r[src + name] for r in group], dim=0)
            for name in _ROW:
                out[dst + name] = torch.cat([r[src + name] for r in group], dim=1)
            for name in _REPLICATED:
                out[dst + name] = _same(dst + name, [r[src + name] for r in group])
    return out


def expected_rank_shapes(config: dict, rank: int) -> dict[str, tuple[int, ...]]:
    """Every weight name of rank ``rank`` with its shape, from the config alone."""
    tp, pp = _mapping(config)
    pp_rank = rank // tp  # every tp rank of a stage holds the same shapes
    h, d = config["hidden_size"], config["head_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    inter = config["intermediate_size"]
    qkv = (heads // tp + 2 * max(kv // tp, 1)) * d
    shapes: dict[str, tuple[int, ...]] = {}
    if pp_rank == 0:
        shapes["transformer.vocab_embedding.weight"] = (config["vocab_size"], h)
    if pp_rank == pp - 1:
        shapes["transformer.ln_f.weight"] = (h,)
        shapes["lm_head.weight"] = (padded_vocab(config["vocab_size"], tp) // tp, h)
    for local in range(len(pp_layers(config["num_hidden_layers"], pp, pp_rank))):
        p = f"transformer.layers.{local}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_layernorm.weight": (h,),
            p + "attention.qkv.weight": (qkv, h),
            p + "attention.dense.weight": (h, heads * d // tp),
            p + "mlp.fc.weight": (inter // tp, h),
            p + "mlp.gate.weight": (inter // tp, h),
            p + "mlp.proj.weight": (h, inter // tp),
        }
        if config["attn_bias"]:
            shapes[p + "attention.qkv.bias"] = (qkv,)
    return shapes
