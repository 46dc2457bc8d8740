"""NVIDIA kvpress side by side: the same LM weights, prompts (image features spliced in), budgets
and reference continuation, measured with the same metrics as vlkv's own policies.

kvpress runs in its own virtualenv and process (``scripts/kvpress_env.py``,
``scripts/kvpress_adapter.py``); this module prepares its inputs and scores its outputs.

Like for like: every press gets the hyper-parameters of the vlkv policy it is compared with
(:func:`matching_press_kwargs`: SnapKV/PyramidKV window and kernel, PyramidKV beta, StreamingLLM
sinks), never kvpress's own defaults unless they are the same.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

from vlkv.eval.kvpress_peer import KvpressJob, run_kvpress
from vlkv.eval.metrics import kl_divergence, perplexity, rouge_l_f1, token_nll, top1_agreement
from vlkv.eval.teacher_forcing import full_reference
from vlkv.runtime.engine import Engine
from vlkv.runtime.policies import Policy, make_policy
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
    "kvzip": "kvzip",
    "kvgrad": "kvgrad",
}
# presses whose memory grows with every job run in one process (see peer_continuation_nll)
LEAKY_PRESSES = ("kvzip", "kvgrad")
# peer names that are also vlkv policy names (their settings are matched)
_VLKV_OF = ("local", "snapkv", "pyramidkv")


def matching_press_kwargs(policy: Policy) -> dict:
    """kvpress press fields equal to ``policy``'s hyper-parameters (empty when none correspond)."""
    name = policy.name
    if name in ("snapkv", "pyramidkv"):
        kw = {"window_size": policy.window, "kernel_size": policy.kernel}
        if name == "pyramidkv":
            kw["beta"] = policy.beta
        return kw
    if name == "local":
        return {"n_sink": policy.sinks}
    return {}


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
        tok = getattr(engine, "tokenizer", None)
        if tok is not None:
            # KVzip/KVgrad presses load the tokenizer from the model directory to build their replay
            # prompt; the protocol feeds raw text, so no chat template wraps the context
            tok = copy.copy(tok)
            tok.chat_template = None
            tok.save_pretrained(out_dir)
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
    # vlkv's default settings of each compared policy, handed to the press (like for like)
    matching = {
        n: matching_press_kwargs(make_policy(n, budget=0.5)) if n in _VLKV_OF else {} for n in presses
    }
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
                    press_kwargs=matching[name],
                    threads=torch.get_num_threads(),  # as many as vlkv's side uses
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
                    "settings": ",".join(f"{k}={v}" for k, v in matching[name].items()),
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


def peer_continuation_nll(
    engine: Engine,
    windows: list,
    configs: list[tuple[str, str, float, dict]],
    work_dir: Path,
    threads: int | None = 1,
    timeout: float = 4 * 3600,
    reference=None,
) -> dict[str, dict]:
    """The continuation protocol (:mod:`vlkv.eval.continuation`) run by kvpress presses.

    Args:
        windows: :class:`~vlkv.eval.continuation.Window` list (token ids, no images).
        configs: ``(label, press, budget, press_kwargs)``; ``press`` a :data:`PEER_PRESSES` value.
        reference: optional :class:`~vlkv.eval.continuation.ReferenceLogits` holding vlkv's
            full-cache logits for every window: the adapter then also returns per-token KL and
            top-1 agreement against them (``kl`` ``(W, T)`` float64, ``top1`` ``(W, T)`` bool).

    Returns ``{label: {"nll": (W, T) float32, "press": ..., "budget": ..., "kept_per_layer": ...}}``;
    a failed press gets ``{"error": "<one line>"}`` instead of ``nll``.
    """
    if reference is not None and not reference.has(windows):
        raise ValueError(f"no full-cache reference logits for every window under {reference.dir}")
    work_dir = Path(work_dir)
    model_dir = export_language_model(engine, work_dir / "lm")
    jobs = [
        KvpressJob(
            model_dir=str(model_dir),
            press=press,
            budget=budget,
            press_kwargs=dict(kwargs),
            mode="logits",
            input_ids=list(w.context),
            continuation_ids=list(w.continuation),
            top_k=0,
            threads=threads,
            reference_logits_path=str(reference.path(w)) if reference is not None else None,
        )
        for _, press, budget, kwargs in configs
        for w in windows
    ]
    if any(press in LEAKY_PRESSES for _, press, _, _ in configs):
        # kvpress 0.5.5's KVzip/KVgrad keep ~3 GB per window alive inside one process (measured on
        # SmolLM2-135M, 800-token contexts): one process per job bounds the peak
        results = [r for job in jobs for r in run_kvpress([job], timeout=timeout)]
    else:
        results = run_kvpress(jobs, timeout=timeout)
    out, n = {}, len(windows)
    for c, (label, press, budget, kwargs) in enumerate(configs):
        rows = results[c * n : (c + 1) * n]
        bad = [r for r in rows if not r.get("ok")]
        entry = {"press": press, "budget": budget, "press_kwargs": dict(kwargs)}
        if bad:
            entry["error"] = str(bad[0].get("error", "unknown error")).splitlines()[0]
        else:
            entry["nll"] = torch.tensor([r["continuation_nll"] for r in rows], dtype=torch.float32)
            entry["kept_per_layer"] = rows[0]["kept_per_layer"]
            entry["prompt_length"] = rows[0]["prompt_length"]
            entry["seconds"] = sum(r.get("job_s", 0.0) for r in rows)
            if reference is not None:
                entry["kl"] = torch.tensor([r["continuation_kl"] for r in rows], dtype=torch.float64)
                entry["top1"] = torch.tensor([r["continuation_top1"] for r in rows], dtype=torch.bool)
        out[label] = entry
    return out
