"""Quality metrics comparing a compressed-cache run against the full-cache run.

Protocols follow the papers: perplexity is Elastic Cache's (exp of the mean NLL over all
tokens of all samples, teacher-forced), ROUGE-L is the LCS F-measure of ``rouge-score``,
and the cache hit rate is VL-Cache's Definition 3.1.
"""

from __future__ import annotations

import math
import re
from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

__all__ = [
    "cache_hit_rate",
    "kl_divergence",
    "lcs_length",
    "perplexity",
    "rouge_l_f1",
    "rouge_l_f1_text",
    "rouge_tokenize",
    "token_nll",
    "top1_agreement",
]


def token_nll(logits: Tensor, targets: Tensor) -> Tensor:
    """Negative log-likelihood of each target token.

    Args:
        logits: ``(T, V)`` float, any dtype; row t scores the token at position t of ``targets``
            (i.e. already shifted: logits of step t predict ``targets[t]``).
        targets: ``(T,)`` int64 token ids in ``[0, V)``.

    Returns:
        ``(T,)`` float32 NLL in nats. Computed in float32 so fp16/bf16 logits do not lose the
        small differences between policies that we are trying to measure.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be (T, V), got shape {tuple(logits.shape)}")
    if targets.shape != logits.shape[:1]:
        raise ValueError(f"targets must be ({logits.shape[0]},), got shape {tuple(targets.shape)}")
    return torch.nn.functional.cross_entropy(logits.float(), targets.long(), reduction="none")


def perplexity(nll: Tensor | Sequence[Tensor]) -> float:
    """Corpus perplexity: ``exp(mean NLL)`` over every token of every sample.

    Args:
        nll: ``(N,)`` per-token NLL in nats with all samples concatenated, or a sequence of
            per-sample ``(T_i,)`` tensors (concatenated here). Elastic Cache averages over
            tokens, not over samples, so long answers weigh more; we keep that protocol.

    Returns:
        Perplexity as a Python float (``inf`` if any NLL is ``inf``).
    """
    if not isinstance(nll, Tensor):
        nll = torch.cat([t.reshape(-1) for t in nll]) if len(nll) else torch.empty(0)
    if nll.dim() != 1 or nll.numel() == 0:
        raise ValueError(f"nll must be a non-empty (N,) tensor, got shape {tuple(nll.shape)}")
    return math.exp(nll.double().mean().item())


def lcs_length(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Length of the longest common subsequence of two token sequences, O(len(a)·len(b)) time."""
    if len(a) < len(b):
        a, b = b, a
    # One row of the DP table suffices; iterate the longer sequence outermost so the row is short.
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l_f1(candidate_tokens: Sequence[Hashable], reference_tokens: Sequence[Hashable]) -> float:
    """ROUGE-L F-measure (beta = 1) between two token sequences.

    Precision = LCS / len(candidate), recall = LCS / len(reference), F = 2PR / (P + R);
    0.0 when either side is empty or nothing matches, as in ``rouge-score``.

    Args:
        candidate_tokens: generated tokens (ids or strings), length C.
        reference_tokens: reference tokens (the full-cache generation), length R.
    """
    if not candidate_tokens or not reference_tokens:
        return 0.0
    lcs = lcs_length(candidate_tokens, reference_tokens)
    if lcs == 0:
        return 0.0
    precision = lcs / len(candidate_tokens)
    recall = lcs / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


_NON_ALNUM = re.compile(r"[^a-z0-9]+")


def rouge_tokenize(text: str) -> list[str]:
    """``rouge-score``'s default tokenizer without stemming: lowercase, split on non-[a-z0-9]."""
    return [tok for tok in _NON_ALNUM.sub(" ", text.lower()).split() if tok]


def rouge_l_f1_text(candidate: str, reference: str) -> float:
    """ROUGE-L F-measure on text, tokenized as ``rouge_score.rouge_scorer.RougeScorer(["rougeL"])``."""
    return rouge_l_f1(rouge_tokenize(candidate), rouge_tokenize(reference))


def _check_pair(p_logits: Tensor, q_logits: Tensor) -> None:
    if p_logits.dim() != 2 or p_logits.shape != q_logits.shape:
        raise ValueError(
            f"p_logits and q_logits must both be (N, V), got {tuple(p_logits.shape)} and {tuple(q_logits.shape)}"
        )


def kl_divergence(p_logits: Tensor, q_logits: Tensor) -> Tensor:
    """Per-row KL(P || Q) with P the full-cache and Q the compressed-cache next-token distribution.

    Args:
        p_logits: ``(N, V)`` logits of the reference (full cache) run.
        q_logits: ``(N, V)`` logits of the compressed run, same rows.

    Returns:
        ``(N,)`` float64 KL in nats, from float64 log-softmax so that tiny divergences of good
        policies are not rounding noise. Tokens with P = 0 (logit ``-inf``) contribute 0.
    """
    _check_pair(p_logits, q_logits)
    log_p = torch.log_softmax(p_logits.double(), dim=-1)
    log_q = torch.log_softmax(q_logits.double(), dim=-1)
    p = log_p.exp()
    terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))
    return terms.sum(dim=-1)


def top1_agreement(p_logits: Tensor, q_logits: Tensor) -> float:
    """Fraction of rows whose argmax token is the same under both runs.

    Args:
        p_logits: ``(N, V)`` reference logits.
        q_logits: ``(N, V)`` compressed-run logits.
    """
    _check_pair(p_logits, q_logits)
    if p_logits.shape[0] == 0:
        raise ValueError("p_logits must have at least one row (N >= 1)")
    return (p_logits.argmax(dim=-1) == q_logits.argmax(dim=-1)).double().mean().item()


def cache_hit_rate(kept_indices: Tensor, true_scores: Tensor, k: int) -> float:
    """VL-Cache Definition 3.1: ``|TopK(true) ∩ kept| / k``, averaged over rows.

    Args:
        kept_indices: ``(*rows, m)`` int64 cache positions a policy kept (usually m = k), for
            example ``(num_layers, num_kv_heads, m)``. Entries ``< 0`` are padding (ragged
            per-row budgets) and ignored; duplicates count once.
        true_scores: ``(*rows, n)`` float; the true attention of the first decode query onto
            the n prompt positions, same leading dims as ``kept_indices``.
        k: size of the true top-k, ``1 <= k <= n``. Ties at the k-th score go to the lower
            position, matching the selection rule of the policies.

    Returns:
        Mean hit rate over all rows, in ``[0, 1]`` when each row keeps at most k entries.
    """
    if kept_indices.shape[:-1] != true_scores.shape[:-1] or true_scores.dim() < 1:
        raise ValueError(
            f"kept_indices (*rows, m) and true_scores (*rows, n) need equal leading dims, "
            f"got {tuple(kept_indices.shape)} and {tuple(true_scores.shape)}"
        )
    n = true_scores.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}], got {k}")
    if kept_indices.numel() and int(kept_indices.max()) >= n:
        raise ValueError(f"kept_indices must be < n = {n}, got max {int(kept_indices.max())}")
    scores = true_scores.reshape(-1, n)
    kept = kept_indices.reshape(scores.shape[0], -1).long()
    # Stable descending sort breaks ties toward the lower index; torch.topk does not promise that.
    top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    in_top = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top, True)
    kept_mask = torch.zeros_like(in_top)
    valid = kept >= 0
    rows = torch.arange(kept.shape[0]).unsqueeze(1).expand_as(kept)
    kept_mask[rows[valid], kept[valid]] = True
    hits = (in_top & kept_mask).sum(dim=-1).double()
    return (hits / k).mean().item()
