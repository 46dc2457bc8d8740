"""NVIDIA kvpress side by side: the same LM weights, prompts (image features spliced in), budgets
and reference continuation, measured with the same metrics as vlkv's own policies.

kvpress runs in its own virtualenv and process (``scripts/kvpress_env.py``,
``scripts/kvpress_adapter.py``); this module prepares its inputs and scores its outputs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from vlkv.eval.kvpress_peer import KvpressJob, run_kvpress
from vlkv.eval.metrics import kl_divergence, perplexity, rouge_l_f1, token_nll, top1_agreement
from vlkv.eval.teacher_forcing import full_reference
from vlkv.runtime.engine import Engine
from vlkv.runtime.prompt import Prompt

# kvpress press for each vlkv policy it corresponds to ("none" = full cache, a sanity check)
PEER_PRESSES = {
    "none": "none",
    "local": "streaming_llm",
    "snapkv": "snapkv",
    "h2o": "observed_attention",
    "pyramidkv": "pyramidkv",
    "knorm": "knorm",
    "expected_attention": "expected_attention",
    "merging": "merging",
}


def export_language_model(engine: Engine, out_dir: Path) -> Path:
    """Save the VLM's language model alone as a ``LlamaForCausalLM``/``MistralForCausalLM`` directory."""
    from transformers import AutoModelForCausalLM

    if engine.loaded.family == "qwen2_vl":
        raise ValueError(
            "kvpress comparison needs a 1-D RoPE LM; Qwen2-VL's M-RoPE is not supported by kvpress"
        )
    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    adapter = engine.backend.adapter
    cfg = adapter.text_config
    saved = cfg._attn_implementation
    cfg._attn_implementation = "sdpa"
    try:
        lm = AutoModelForCausalLM.from_config(cfg)
        state = {f"model.{k}": v for k, v in adapter.lm.state_dict().items()}
        state["lm_head.weight"] = adapter.lm_head.weight
        lm.load_state_dict(state, strict=False)
        lm.save_pretrained(out_dir)
    finally:
        cfg._attn_implementation = saved
    return out_dir


def peer_quality_records(
    engine: Engine,
    prompts: list[Prompt],
    presses: list[str],
    budgets: list[float],
    new_tokens: int,
    work_dir: Path,
) -> list[dict]:
    """One record per (press, budget), against vlkv's full cache on the same reference tokens."""
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = export_language_model(engine, work_dir / "lm")
    ref = full_reference(engine, prompts, new_tokens)
    reference, full_logits = ref.tokens, ref.logits
    batch = engine.encode(prompts)
    embeds, lengths = engine.backend.embed(batch), batch.lengths
    jobs, keys = [], []
    for i, ref in enumerate(reference):
        emb_path = work_dir / f"embeds{i}.pt"
        torch.save(embeds[i, : lengths[i]].float().clone(), emb_path)
        for name in presses:
            for budget in [1.0] if name == "none" else budgets:
                common = dict(
                    model_dir=str(model_dir),
                    press=PEER_PRESSES[name],
                    budget=budget,
                    inputs_embeds_path=str(emb_path),
                )
                logits_path = work_dir / f"logits_{name}_{budget}_{i}.pt"
                # row t of the returned logits predicts ref[t], as in forced_logits
                jobs.append(
                    KvpressJob(**common, mode="logits", continuation_ids=ref, logits_path=str(logits_path))
                )
                jobs.append(KvpressJob(**common, mode="greedy", max_new_tokens=new_tokens))
                keys.append((name, budget, i, logits_path))
    results = run_kvpress(jobs)
    records = []
    for name in presses:
        for budget in [1.0] if name == "none" else budgets:
            failed = _first_error(results, keys, name, budget)
            if failed:
                # one press failing inside kvpress must not cost the other measurements
                print(f"kvpress {PEER_PRESSES[name]} at budget {budget} failed: {failed}", file=sys.stderr)
                records.append(
                    {
                        "kind": "peer_failure",
                        "policy": f"kvpress:{PEER_PRESSES[name]}",
                        "budget": budget,
                        "error": failed,
                    }
                )
                continue
            nll, full_nll, p_rows, q_rows, rouge = [], [], [], [], []
            for k, (kname, kbudget, i, logits_path) in enumerate(keys):
                if (kname, kbudget) != (name, budget):
                    continue
                forced, greedy = results[2 * k], results[2 * k + 1]
                if not (forced.get("ok") and greedy.get("ok")):
                    raise RuntimeError(
                        f"kvpress {name} at {budget} failed: {forced.get('error') or greedy.get('error')}"
                    )
                q = _peer_logits(logits_path, len(reference[i]))
                target = torch.tensor(reference[i])
                nll.append(token_nll(q, target))
                full_nll.append(token_nll(full_logits[i], target))
                p_rows.append(full_logits[i])
                q_rows.append(q)
                rouge.append(rouge_l_f1(greedy["generated_ids"], reference[i]))
            p, q = torch.cat(p_rows), torch.cat(q_rows)
            records.append(
                {
                    "kind": "quality",
                    "policy": f"kvpress:{PEER_PRESSES[name]}",
                    "budget": budget,
                    "ppl": perplexity(nll),
                    "full_ppl": perplexity(full_nll),
                    "kl_mean": float(kl_divergence(p, q).mean()),
                    "top1_agreement": top1_agreement(p, q),
                    "rouge_l": sum(rouge) / len(rouge),
                }
            )
    return records


def _first_error(results: list[dict], keys: list, name: str, budget: float) -> str | None:
    for k, (kname, kbudget, _, _) in enumerate(keys):
        if (kname, kbudget) == (name, budget):
            for r in results[2 * k : 2 * k + 2]:
                if not r.get("ok"):
                    return str(r.get("error", "unknown error")).splitlines()[0]
    return None


def _peer_logits(path: Path, steps: int) -> torch.Tensor:
    """kvpress's ``(T, V)`` logits with row 0 = the prompt's prediction, aligned to the reference."""
    logits = torch.load(path).float()
    if logits.shape[0] != steps:
        raise RuntimeError(
            f"kvpress returned {logits.shape[0]} logit rows for a {steps}-token reference ({path})"
        )
    return logits
