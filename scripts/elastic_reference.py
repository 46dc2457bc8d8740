"""Elastic Cache as its authors' code runs it, re-implemented over a Hugging Face causal LM.

An independent port (no vlkv runtime code) of ``ElasticCache`` in liuzuyan/ElasticCache@3138e03
``kv_cache.py`` and the teacher-forced loop of its ``eval_ppl.py``, so vlkv's ``elastic`` policy can
be compared with it layer by layer and step by step on the same weights and text
(``scripts/elastic_compare.py``, ``tests/runtime/policies/test_elastic_reference.py``).

What the authors' code does (methods.md §1), and what this port reproduces:

* the cache is a list of per-layer ``(k, v)``, ``(1, H_kv, S, D)``, keys post-RoPE;
* after the prompt's forward (``n`` tokens, attention probabilities ``(1, H, n, n)`` per layer)
  ``score[l, j]`` = sum over every prompt row of the head-mean attention; ``f = int(n - n·(1-r))``
  with ``r`` the *forgotten* fraction; candidates ``C = [start, n - protect)``;
* anchors, thrown tokens and the merge target of each thrown token (nearest anchor, ties to the
  lower one) are chosen per layer; anchor K/V become the mean of themselves and the thrown tokens
  assigned to them (``scatter_reduce(..., "mean")``, ``include_self=True``); the cache becomes
  ``[first start] + anchors + [last protect]``; the fixed point is ``P = n - f + distance``;
* after every later forward (``N`` tokens seen, cache length ``L``): if ``int(L - N·(1-r)) >= 1``
  the entry at ``P`` is deleted from every layer;
* new tokens get position ``L`` (HF 4.31 numbers a new token by the cache length): positions are
  compacted. ``positions="original"`` numbers them as the uncompressed prompt would instead.

``quirks=True`` (what the code does) picks anchors as ``{j + start : argsort(S_C)[j] > f}`` and
thrown tokens as ``{j : argsort(S_C)[j] <= f}`` (argsort positions, not ranks, and the thrown
indices not shifted by ``start``), and an ``f == 1`` prompt takes the decode branch with ``P = 0``.
``quirks=False`` is the method the paper describes: the top-``|C| - 1 - f`` candidates by score are
the anchors and every other candidate is thrown.

Batch size 1, as in the authors' code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


def nearest(anchors: Tensor, thrown: Tensor) -> Tensor:
    """Per thrown slot ``(T,)`` the nearest of ascending ``anchors (A,)`` (first minimum = lower)."""
    return anchors[(anchors[None, :] - thrown[:, None]).abs().argmin(1)]


@dataclass
class ReferenceElastic:
    """The authors' ``ElasticCache`` for one request.

    Attributes:
        ratio: fraction of tokens *forgotten* (vlkv's budget is ``1 - ratio``).
        start, protect, distance: as in the authors' eval scripts (1, 1, -25).
        quirks: reproduce the code's anchor/thrown selection (see the module docstring).
        layer_pos: per layer, ``(S,)`` int64 rotary position of every cache entry (its anchor's
            position after merging), kept beside the cache to compare kept sets.
    """

    ratio: float
    start: int = 1
    protect: int = 1
    distance: int = -25
    quirks: bool = True
    score: Tensor | None = None
    fixed: int = 0
    prefilled: bool = False
    layer_pos: list[Tensor] = field(default_factory=list)
    plans: list[dict] = field(default_factory=list)

    def _select(self, s: Tensor, f: int, n: int) -> tuple[Tensor, Tensor]:
        """Anchor slots (ascending) and thrown slots for one layer's candidate scores ``s (|C|,)``."""
        if self.quirks:
            order = torch.argsort(s)  # the code compares argsort *positions* with f
            return torch.where(order > f)[0] + self.start, torch.where(order <= f)[0]
        cand = torch.arange(self.start, n - self.protect)
        keep = cand.numel() - 1 - f
        top = torch.sort(s, descending=True, stable=True).indices[:keep]
        anchors = torch.sort(cand[top]).values
        thrown = cand[~torch.isin(cand, anchors)]
        return anchors, thrown

    def __call__(self, past: list[tuple[Tensor, Tensor]], seen: int, attentions=None, new_pos=None):
        """Edit ``past`` after a forward; ``seen`` counts every token processed so far.

        ``attentions``: per layer ``(1, H, q, S)`` probabilities (needed for the prompt's forward).
        ``new_pos``: ``(q,)`` rotary positions the forward gave its tokens (for ``layer_pos``).
        """
        seq_len = past[0][0].shape[2]
        q = attentions[0].shape[-2] if attentions else 1
        if new_pos is not None:
            if not self.layer_pos:
                self.layer_pos = [new_pos.clone() for _ in past]
            else:
                self.layer_pos = [torch.cat([p, new_pos]) for p in self.layer_pos]
        if q > 1:  # the prompt: column sums of the head-mean attention, every row
            assert not self.prefilled
            self.score = torch.stack([a[0].float().mean(0).sum(0) for a in attentions])  # (L, n)
        forget = int(seq_len - seen * (1 - self.ratio))
        if forget <= 0:
            return past
        if forget > 1 or (q > 1 and not self.quirks):
            assert not self.prefilled, "the authors' code asserts this: one merge, at the prompt"
            self.prefilled = True
            return self._merge(past, forget, seq_len)
        # fixed-point elimination (with quirks, also an f == 1 prompt's path, with P = 0)
        p = self.fixed
        self.layer_pos = [torch.cat([lp[:p], lp[p + 1 :]]) for lp in self.layer_pos]
        return [
            (torch.cat([k[:, :, :p], k[:, :, p + 1 :]], 2), torch.cat([v[:, :, :p], v[:, :, p + 1 :]], 2))
            for k, v in past
        ]

    def _merge(self, past, f: int, n: int):
        self.fixed = self.distance if self.distance > 0 else n - f + self.distance
        out, self.plans = [], []
        for layer, (k, v) in enumerate(past):
            anchors, thrown = self._select(self.score[layer, self.start : n - self.protect], f, n)
            target = nearest(anchors, thrown)
            kept = torch.cat([torch.arange(self.start), anchors, torch.arange(n - self.protect, n)])
            self.plans.append({"anchors": anchors, "thrown": thrown, "target": target, "kept": kept})
            b, h, _, d = k.shape
            idx = lambda i, b=b, h=h, d=d: i.view(1, 1, -1, 1).expand(b, h, -1, d)  # noqa: E731
            k = k.scatter_reduce(2, idx(target), k.gather(2, idx(thrown)), "mean")
            v = v.scatter_reduce(2, idx(target), v.gather(2, idx(thrown)), "mean")
            out.append((k.gather(2, idx(kept)), v.gather(2, idx(kept))))
            if self.layer_pos:
                self.layer_pos[layer] = self.layer_pos[layer][kept]
        return out


@dataclass
class StepRecord:
    """One forward of the reference loop: the NLL of its target and the cache after the edit."""

    nll: float
    logits: Tensor  # (V,) float32
    lengths: list[int]
    layer_pos: list[Tensor]
    kv: list[tuple[Tensor, Tensor]] | None = None


def _forward(model, ids: Tensor, past, positions: Tensor, want_attn: bool):
    from transformers import DynamicCache

    cache = DynamicCache(ddp_cache_data=past) if past is not None else None
    out = model(
        input_ids=ids[None],
        past_key_values=cache,
        position_ids=positions[None],
        use_cache=True,
        output_attentions=want_attn,
    )
    new_past = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    return out.logits[0].float(), new_past, out.attentions


@torch.no_grad()
def run_reference(
    model,
    prompt: Tensor,
    continuation: Tensor,
    ratio: float | None,
    positions: str = "compacted",
    quirks: bool = True,
    keep_kv: bool = False,
    once: bool = False,
    **kwargs,
) -> list[StepRecord]:
    """The authors' teacher-forced loop: prefill ``prompt (n,)``, then feed ``continuation (T,)``.

    Step 0 is the prompt's forward (predicting ``continuation[0]``), step t feeds
    ``continuation[t-1]`` and predicts ``continuation[t]``; the cache policy edits after each.
    ``once=True`` compresses after the prompt only and feeds the continuation in one chunk (no
    fixed-point elimination; records then hold only NLL and logits after step 0).
    ``ratio=None`` runs the full cache. ``model`` must run eager attention.
    """
    n = prompt.numel()
    policy = ReferenceElastic(ratio, quirks=quirks, **kwargs) if ratio is not None else None
    pos = torch.arange(n)
    logits, past, attn = _forward(model, prompt, None, pos, policy is not None)
    seen, records = n, []
    if once:
        if policy is not None:
            past = policy(past, seen, attn, pos)
        length, t = past[0][0].shape[2], continuation.numel()
        start = length if positions == "compacted" else n
        chunk, _, _ = _forward(model, continuation[:-1], past, start + torch.arange(t - 1), False)
        rows = torch.cat([logits[-1:], chunk])
        nll = torch.nn.functional.cross_entropy(rows, continuation, reduction="none")
        return [StepRecord(float(x), r, [], []) for x, r in zip(nll, rows)]
    for t in range(continuation.numel()):
        if t > 0:
            length = past[0][0].shape[2]
            p = length if positions == "compacted" else n + t - 1
            pos = torch.tensor([p])
            logits, past, attn = _forward(model, continuation[t - 1 : t], past, pos, False)
            seen += 1
        if policy is not None:
            past = policy(past, seen, attn, pos)
        lp = policy.layer_pos if policy is not None else []
        row = logits[-1]
        nll = float(torch.nn.functional.cross_entropy(row[None], continuation[t : t + 1]))
        records.append(
            StepRecord(
                nll, row, [k.shape[2] for k, _ in past], [x.clone() for x in lp], past if keep_kv else None
            )
        )
    return records
