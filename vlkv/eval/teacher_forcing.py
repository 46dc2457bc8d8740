"""Quality of a policy against the full cache, measured the way Elastic Cache does.

* teacher-forced NLL / perplexity: prefill the prompt, then feed the reference continuation one
  token at a time, the policy acting after prefill and after **every** decode step;
* KL(full ‖ policy) and top-1 agreement of the next-token distributions along the same reference;
* ROUGE-L F1 of the policy's own greedy generation against the full cache's greedy generation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vlkv.eval.metrics import kl_divergence, perplexity, rouge_l_f1, token_nll, top1_agreement
from vlkv.runtime.engine import Engine
from vlkv.runtime.policies import Policy, make_policy
from vlkv.runtime.prompt import Prompt


@torch.no_grad()
def forced_logits(
    engine: Engine, prompts: list[Prompt], policy: Policy, references: list[list[int]]
) -> list[Tensor]:
    """Next-token logits along each reference, the policy editing the cache at every step.

    Returns, per sample, ``(len(reference), V)`` float32: row ``t`` predicts ``reference[t]``.
    """
    batch = engine.encode(prompts)
    cache = engine.new_cache(batch)
    steps = max(len(r) for r in references)
    out = engine.prefill(batch, policy, cache)
    rows = [out.logits]
    for t in range(steps - 1):
        # samples whose reference ended keep feeding their last token; those rows are dropped below
        tokens = torch.tensor([r[min(t, len(r) - 1)] for r in references])
        out = engine.decode(tokens, batch, policy, cache, t + 1)
        rows.append(out.logits)
    logits = torch.stack(rows, 1)  # (B, steps, V)
    return [logits[b, : len(r)] for b, r in enumerate(references)]


@dataclass
class QualityReport:
    """One policy/budget against the full cache on a batch of prompts."""

    policy: str
    budget: float
    ppl: float
    full_ppl: float
    kl_mean: float
    top1_agreement: float
    rouge_l: float

    def as_record(self) -> dict:
        return dict(self.__dict__)


@dataclass
class FullReference:
    """The full cache's greedy continuation of each prompt and its teacher-forced logits along it."""

    tokens: list[list[int]]
    logits: list[Tensor]


def full_reference(engine: Engine, prompts: list[Prompt], new_tokens: int) -> FullReference:
    """Computed once per prompt set and shared by every policy/budget compared against it."""
    full = make_policy("full")
    # equal-length references for every sample
    tokens = [s.token_ids for s in engine.generate(prompts, full, new_tokens, stop_at_eos=False).samples]
    return FullReference(tokens, forced_logits(engine, prompts, full, tokens))


def compare_to_full(
    engine: Engine,
    prompts: list[Prompt],
    policy: Policy,
    new_tokens: int = 32,
    reference: FullReference | None = None,
) -> QualityReport:
    """Score ``policy`` against the full cache (see module docstring); pass ``reference`` to reuse it."""
    ref = reference or full_reference(engine, prompts, new_tokens)
    candidate = [s.token_ids for s in engine.generate(prompts, policy, new_tokens, stop_at_eos=False).samples]
    pol_logits = forced_logits(engine, prompts, policy, ref.tokens)
    targets = [torch.tensor(r) for r in ref.tokens]
    nll = [token_nll(lg, t) for lg, t in zip(pol_logits, targets)]
    full_nll = [token_nll(lg, t) for lg, t in zip(ref.logits, targets)]
    p, q = torch.cat(ref.logits), torch.cat(pol_logits)
    return QualityReport(
        policy=policy.name,
        budget=policy.budget,
        ppl=perplexity(nll),
        full_ppl=perplexity(full_nll),
        kl_mean=float(kl_divergence(p, q).mean()),
        top1_agreement=top1_agreement(p, q),
        rouge_l=sum(rouge_l_f1(c, r) for c, r in zip(candidate, ref.tokens)) / len(ref.tokens),
    )
