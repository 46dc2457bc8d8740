"""The attention sink an image record is computed after.

A record computed from position 0 with nothing before it makes the image's first token the sequence's
first token: it takes over the attention-sink role that the template's opening (``<|im_start|>``, BOS)
plays in every real prompt, and every image K/V entry comes out different from the same image inside
a prompt. Measured on the trained ``smollm2-llava``: one picture at the same position after the same 3
opening tokens, full reuse agreed 0.80 top-1 with full recompute (KL 0.78); computed after those tokens,
1.000 (KL 0). So a record is computed after the model's template opening — the tokens its prompt
template puts before the first image, the same for every prompt of the model — and keeps only the
image's rows. The opening joins the record's identity: a record made after another opening (or with
none, by an older vlkv) is another record, never linked as this one.
"""

from __future__ import annotations

import torch
from torch import Tensor

_ATTR = "_vlkv_link_sink"


def sink_ids(engine) -> list[int]:
    """The token ids the model's prompt template puts before its first image (computed once per engine).

    Raw prompts use the same opening: a record is one fixed computation per image and model, whatever
    the prompt it is later linked into.
    """
    cached = getattr(engine, _ATTR, None)
    if cached is not None:
        return cached
    text = engine.loaded.prompt_template("", 1)
    at = text.find(engine.placeholder)
    if at < 0:
        raise ValueError(f"the prompt template has no image placeholder {engine.placeholder!r}")
    ids = [int(i) for i in engine.tokenizer(text[:at])["input_ids"]]  # as the processor starts a prompt
    setattr(engine, _ATTR, ids)
    return ids


def with_sink(engine, emb: Tensor, positions: Tensor, input_ids: Tensor, modality: Tensor):
    """One image's step inputs with the sink before them.

    Args:
        emb: ``(1, n, hidden)`` the image's input embeddings.
        positions: ``(1, n, P)`` the image's own positions from 0 (M-RoPE: its grid ids).
        input_ids: ``(1, n)`` int64, modality: ``(1, n)`` int8.

    Returns ``(embeds, positions, input_ids, modality, s)``: ``(1, s + n, ...)`` each, the image's
    positions shifted past the ``s`` sink tokens (text positions ``0..s-1`` in every component, as
    Qwen2-VL's ``get_rope_index`` places text before an image).
    """
    from vlkv.runtime.cache import Modality

    ids = sink_ids(engine)
    s, dev = len(ids), emb.device
    if s == 0:
        return emb, positions, input_ids, modality, 0
    sink = torch.tensor([ids], dtype=torch.long, device=dev)
    sink_emb = engine.backend.adapter.embed_tokens(sink.to(engine.backend.device)).to(emb)
    p = positions.shape[-1]
    sink_pos = torch.arange(s, dtype=positions.dtype, device=positions.device)[None, :, None].expand(1, s, p)
    sink_mod = torch.full((1, s), int(Modality.TEXT), dtype=modality.dtype, device=modality.device)
    return (
        torch.cat([sink_emb, emb], 1),
        torch.cat([sink_pos, positions + s], 1),
        torch.cat([sink.to(input_ids.device), input_ids], 1),
        torch.cat([sink_mod, modality], 1),
        s,
    )
