"""Run NVIDIA kvpress presses on a saved HF causal LM, for side-by-side comparison with vlkv.

This script runs INSIDE the kvpress virtualenv (``python scripts/kvpress_env.py`` creates it),
never in vlkv's own environment: kvpress pins ``transformers<5.3``. It does not import vlkv.
vlkv talks to it through files only::

    .venvs/kvpress/bin/python scripts/kvpress_adapter.py jobs.json results.json

``jobs.json`` holds one job object or a list of them; ``results.json`` gets one result per job
in the same order. A failing job yields ``{"ok": false, "error": "<one line>"}`` and the others
still run; the exit status is 1 if any job failed.

Job fields (defaults in :data:`JOB_DEFAULTS`):
    model_dir            saved Llama-family ``*ForCausalLM`` (``save_pretrained`` output).
    input_ids            prompt token ids, length n; or
    inputs_embeds_path   ``.pt`` float tensor ``(n, hidden)`` or ``(1, n, hidden)``: the prompt with
                         image features already spliced in at the image-token rows (vlkv builds it
                         with the VLM's embedding table and projector). Exactly one of the two.
    question_ids         optional ids appended AFTER compression, uncompressed (kvpress pipeline's
                         context/question split). Default: none, the whole prompt is compressed.
    press                a key of :data:`PRESSES`; ``"none"`` runs the full cache.
    budget               kept fraction in (0, 1]; kvpress's ``compression_ratio = 1 - budget``.
    keep_rounding        ``vlkv`` (default): kvpress keeps exactly round(n·budget) entries, as vlkv
                         does; ``kvpress``: plain ``1 - budget`` with kvpress's floor.
    press_kwargs         extra press fields, e.g. ``{"window_size": 8}``; ``merging`` takes
                         ``{"inner": "<scorer press name>", ...}``.
    mode                 ``greedy`` (generate ``max_new_tokens`` ids), ``logits`` (teacher-forced
                         next-token logits over ``continuation_ids``; the result's
                         ``continuation_nll`` holds each token's NLL in nats) or ``timing``.
    threads              torch CPU threads (timing reproducibility); default: torch's choice.
    clock                mode ``timing``: ``wall`` (default) or ``cpu`` (the process's CPU time,
                         steadier on a machine shared with other jobs; CPU runs only).
    top_k                top-k logits per step kept in the JSON (0 disables).
    logits_path          if set, full per-step logits ``(T, V)`` float32 are saved there.
    reference_logits_path
                         mode ``logits`` only: a ``(T, V)`` float ``.pt`` of the full cache's logits
                         over the same continuation (vlkv's); the result then holds
                         ``continuation_kl`` (KL(reference ‖ this run) per token, nats, float64
                         log-softmax) and ``continuation_top1`` (argmax equal, per token).
    kept_indices_path    if set, kept prompt positions per layer are saved there: a list of
                         ``(num_kv_heads, m_l)`` int64 tensors (ascending; -1 if unmatched).

Positions: decoding continues at the ORIGINAL positions (n, n+1, ...), as kvpress's own
pipeline does; the attention mask covers the compressed cache only.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path

import torch

JOB_DEFAULTS = {
    "input_ids": None,
    "inputs_embeds_path": None,
    "question_ids": None,
    "press": "none",
    "budget": 1.0,
    "keep_rounding": "vlkv",
    "press_kwargs": {},
    "mode": "greedy",
    "max_new_tokens": 16,
    "stop_on_eos": False,
    "continuation_ids": None,
    "top_k": 5,
    "logits_path": None,
    "reference_logits_path": None,
    "kept_indices_path": None,
    "attn_implementation": None,
    "dtype": "float32",
    "device": "cpu",
    "warmup": 1,
    "repeats": 3,
    "threads": None,
    "clock": "wall",
}
MODES = ("greedy", "logits", "timing")
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}

# vlkv-side name -> kvpress class name. Resolved lazily so that this table can be imported
# (and listed by --list) without paying kvpress's ~20 s import.
PRESSES: dict[str, str | None] = {
    "none": None,
    "streaming_llm": "StreamingLLMPress",
    "snapkv": "SnapKVPress",
    "observed_attention": "ObservedAttentionPress",
    "pyramidkv": "PyramidKVPress",
    "knorm": "KnormPress",
    "expected_attention": "ExpectedAttentionPress",
    "tova": "TOVAPress",
    "random": "RandomPress",
    "merging": "MergingPress",
    "kvzip": "KVzipPress",  # context-reconstruction scores (query-agnostic)
    "kvgrad": "KVgradPress",  # KVzip's replay weighted by ||v W_O|| and gradient attribution
}
# ObservedAttention scores from the eager attention probabilities; SDPA does not return them.
NEEDS_EAGER = {"observed_attention"}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def press_ratio(budget: float, n: int, keep_rounding: str) -> float:
    """The ``compression_ratio`` to hand kvpress for a kept fraction ``budget`` of ``n`` entries.

    kvpress keeps ``int(n * (1 - ratio))`` entries. With ``keep_rounding="kvpress"`` the ratio is
    plainly ``1 - budget`` (floor; float rounding can drop one more entry: n=40, budget=0.1 keeps
    3). With ``"vlkv"`` the ratio is chosen so kvpress keeps exactly ``round(n * budget)``
    (at least 1), the count vlkv's policies keep, so both sides compare at equal cache size.
    """
    if keep_rounding == "kvpress":
        return 1.0 - budget
    if keep_rounding != "vlkv":
        raise ValueError(f"keep_rounding must be 'vlkv' or 'kvpress', got {keep_rounding!r}")
    k = min(max(round(n * budget), 1), n)
    # Aim at the middle of [k, k+1) so int() lands on k whatever the float rounding.
    return 0.0 if k == n else 1.0 - (k + 0.5) / n


def make_press(name: str, ratio: float, press_kwargs: dict):
    """Build the kvpress object for ``name`` at ``compression_ratio=ratio``; None for the full cache."""
    if name not in PRESSES:
        raise ValueError(f"unknown press {name!r}; known: {sorted(PRESSES)}")
    if PRESSES[name] is None:
        return None
    import kvpress

    kwargs = dict(press_kwargs)
    if name == "merging":
        inner_name = kwargs.pop("inner", "snapkv")
        inner_kwargs = kwargs.pop("inner_kwargs", {})
        inner = make_press(inner_name, ratio, inner_kwargs)
        if not isinstance(inner, kvpress.ScorerPress):
            raise ValueError(f"merging needs a scorer press as inner, got {inner_name!r}")
        return kvpress.MergingPress(press=inner, **kwargs)
    return getattr(kvpress, PRESSES[name])(compression_ratio=ratio, **kwargs)


class _ModelCache:
    """Keeps the last loaded model so a batch of jobs on one model loads it once."""

    def __init__(self):
        self.key = None
        self.model = None

    def get(self, model_dir: str, attn: str, dtype: str, device: str):
        from transformers import AutoModelForCausalLM

        key = (model_dir, attn, dtype, device)
        if key != self.key:
            self.model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=getattr(torch, dtype), attn_implementation=attn
            ).to(device)
            self.model.eval()
            self.key = key
        return self.model


class _KeptRecorder:
    """Wraps a press's ``compress`` to record which prompt rows each layer kept.

    kvpress gathers kept keys by top-k and returns them in score order, without the indices.
    Rows are recovered by exact byte match against the uncompressed keys of the same call,
    which is unambiguous because RoPE makes keys at distinct positions distinct.
    """

    def __init__(self, press):
        self.indices: dict[int, torch.Tensor] = {}
        original = press.compress

        def compress(module, hidden_states, keys, values, attentions, kwargs):
            new_keys, new_values = original(module, hidden_states, keys, values, attentions, kwargs)
            self.indices[module.layer_idx] = _match_rows(keys[0], new_keys[0])
            return new_keys, new_values

        press.compress = compress


def _match_rows(full: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """full ``(H, n, D)``, kept ``(H, m, D)`` -> ``(H, m)`` int64 positions, ascending, -1 if absent."""
    full, kept = full.detach().float().cpu().contiguous(), kept.detach().float().cpu().contiguous()
    out = torch.full(kept.shape[:2], -1, dtype=torch.long)
    for h in range(full.shape[0]):
        lookup = {full[h, j].numpy().tobytes(): j for j in range(full.shape[1])}
        for i in range(kept.shape[1]):
            out[h, i] = lookup.get(kept[h, i].numpy().tobytes(), -1)
    return out.sort(dim=-1).values


def _prompt_inputs(job: dict, model) -> tuple[dict, int]:
    device = job["device"]
    if (job["input_ids"] is None) == (job["inputs_embeds_path"] is None):
        raise ValueError("give exactly one of input_ids and inputs_embeds_path")
    if job["input_ids"] is not None:
        ids = torch.tensor([job["input_ids"]], dtype=torch.long, device=device)
        return {"input_ids": ids}, ids.shape[1]
    embeds = torch.load(job["inputs_embeds_path"], map_location=device, weights_only=True)
    if embeds.dim() == 2:
        embeds = embeds.unsqueeze(0)
    hidden = model.config.hidden_size
    if embeds.dim() != 3 or embeds.shape[0] != 1 or embeds.shape[2] != hidden:
        raise ValueError(
            f"inputs_embeds must be (n, {hidden}) or (1, n, {hidden}), got {tuple(embeds.shape)}"
        )
    return {"inputs_embeds": embeds.to(model.dtype)}, embeds.shape[1]


def _prefill(model, press, inputs: dict, question_ids, n: int, device: str):
    """Compressed prefill (+ uncompressed question); returns (cache, last logits (V,), next position)."""
    from contextlib import nullcontext

    from transformers import DynamicCache

    cache = DynamicCache()
    ctx = press(model) if press is not None else nullcontext()
    with ctx, torch.no_grad():
        out = model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
    pos = n
    if question_ids:
        q = torch.tensor([question_ids], dtype=torch.long, device=device)
        positions = torch.arange(pos, pos + q.shape[1], device=device).unsqueeze(0)
        with torch.no_grad():
            out = model(input_ids=q, past_key_values=cache, position_ids=positions, logits_to_keep=1)
        pos += q.shape[1]
    return cache, out.logits[0, -1], pos


def _step(model, cache, token: int, pos: int, device: str) -> torch.Tensor:
    ids = torch.tensor([[token]], dtype=torch.long, device=device)
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, position_ids=torch.tensor([[pos]], device=device))
    return out.logits[0, -1]


def _greedy(model, cache, first_logits, pos, job, eos: set[int], now=time.perf_counter):
    """Greedy decode from ``first_logits (V,)``; returns ids, ``(steps, V)`` logits and the seconds it
    took on ``now`` (the job's clock: wall or the process's CPU time)."""
    logits, ids = [first_logits], [int(first_logits.argmax())]
    t0 = now()
    while len(ids) < job["max_new_tokens"] and not (job["stop_on_eos"] and ids[-1] in eos):
        logits.append(_step(model, cache, ids[-1], pos, job["device"]))
        ids.append(int(logits[-1].argmax()))
        pos += 1
    _sync(job["device"])
    return ids, torch.stack(logits), now() - t0


def _teacher_forced(model, cache, first_logits, pos, job):
    cont = job["continuation_ids"]
    if not cont:
        raise ValueError("mode 'logits' needs non-empty continuation_ids")
    rows = [first_logits]
    if len(cont) > 1:
        # No press is active after prefill, so feeding the continuation in one forward gives the
        # same logits as feeding it token by token.
        ids = torch.tensor([cont[:-1]], dtype=torch.long, device=job["device"])
        positions = torch.arange(pos, pos + len(cont) - 1, device=job["device"]).unsqueeze(0)
        with torch.no_grad():
            out = model(input_ids=ids, past_key_values=cache, position_ids=positions)
        rows.extend(out.logits[0])
    return torch.stack(rows)


def _against_reference(logits: torch.Tensor, path: str) -> dict:
    """Per-token KL(reference ‖ logits) and top-1 agreement; logits and the file both ``(T, V)``."""
    ref = torch.load(path, map_location="cpu", weights_only=True)
    logits = logits.detach().cpu()
    if ref.shape != logits.shape:
        raise ValueError(f"reference logits {tuple(ref.shape)} in {path} do not match {tuple(logits.shape)}")
    log_p = torch.log_softmax(ref.double(), dim=-1)
    log_q = torch.log_softmax(logits.double(), dim=-1)
    p = log_p.exp()
    kl = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)
    return {
        "continuation_kl": kl.tolist(),
        "continuation_top1": (ref.argmax(-1) == logits.argmax(-1)).tolist(),
    }


def _kept_per_layer(cache, question_ids) -> list[int]:
    """Prompt entries left in each layer right after prefill (the uncompressed question excluded)."""
    return [layer.keys.shape[2] - len(question_ids or ()) for layer in cache.layers]


def run_job(job: dict, models: _ModelCache) -> dict:
    """Run one job (see module docstring) and return its JSON-able result."""
    unknown = set(job) - set(JOB_DEFAULTS) - {"model_dir", "id"}
    if unknown:
        raise ValueError(
            f"unknown job field(s) {sorted(unknown)}; known: {sorted(JOB_DEFAULTS)} + model_dir, id"
        )
    job = {**JOB_DEFAULTS, **job}
    if job["threads"]:
        torch.set_num_threads(int(job["threads"]))
    if job["mode"] not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {job['mode']!r}")
    if job["clock"] not in CLOCKS:
        raise ValueError(f"clock must be one of {tuple(CLOCKS)}, got {job['clock']!r}")
    attn = job["attn_implementation"] or ("eager" if job["press"] in NEEDS_EAGER else "sdpa")
    if not 0 < job["budget"] <= 1:
        raise ValueError(f"budget must be in (0, 1], got {job['budget']}")
    model = models.get(str(job["model_dir"]), attn, job["dtype"], job["device"])
    inputs, n = _prompt_inputs(job, model)
    ratio = press_ratio(float(job["budget"]), n, job["keep_rounding"])
    press = make_press(job["press"], ratio, job["press_kwargs"])
    # Matching rows costs O(n) Python work per head, so only when asked and never while timing.
    recorder = None
    if press is not None and job["kept_indices_path"] and job["mode"] != "timing":
        recorder = _KeptRecorder(press)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    result = {
        "ok": True,
        "id": job.get("id"),
        "press": job["press"],
        "press_repr": repr(press),
        "budget": job["budget"],
        "compression_ratio": 1.0 - job["budget"],
        "compression_ratio_passed": ratio,
        "keep_rounding": job["keep_rounding"],
        "mode": job["mode"],
        "prompt_length": n,
        "attn_implementation": attn,
        "positions": "original",
        "versions": {k: metadata.version(k) for k in ("kvpress", "transformers", "torch")},
    }
    if job["mode"] == "timing":
        prefill_s, decode_s = [], []
        now = CLOCKS[job["clock"]]
        for i in range(job["warmup"] + job["repeats"]):
            _sync(job["device"])
            t0 = now()
            cache, first, pos = _prefill(model, press, inputs, job["question_ids"], n, job["device"])
            _sync(job["device"])
            t1 = now()
            kept = _kept_per_layer(cache, job["question_ids"])
            ids, _, dt = _greedy(model, cache, first, pos, {**job, "stop_on_eos": False}, eos, now)
            if i >= job["warmup"]:
                prefill_s.append(t1 - t0)
                decode_s.append(dt)
        result.update(
            clock=job["clock"],
            prefill_s=min(prefill_s),
            decode_s=min(decode_s),
            decode_tokens=len(ids) - 1,
            prefill_s_all=prefill_s,
            decode_s_all=decode_s,
            kept_per_layer=kept,
        )
        return result

    _sync(job["device"])
    t0 = time.perf_counter()
    cache, first, pos = _prefill(model, press, inputs, job["question_ids"], n, job["device"])
    _sync(job["device"])
    result["prefill_s"] = time.perf_counter() - t0
    result["kept_per_layer"] = _kept_per_layer(cache, job["question_ids"])
    if job["mode"] == "greedy":
        ids, logits, result["decode_s"] = _greedy(model, cache, first, pos, job, eos)
        result["generated_ids"] = ids
    else:
        logits = _teacher_forced(model, cache, first, pos, job)
        # per-token NLL of the continuation: lets callers skip the (T, V) logits file
        target = torch.tensor(job["continuation_ids"], dtype=torch.long, device=logits.device)
        result["continuation_nll"] = torch.nn.functional.cross_entropy(
            logits.float(), target, reduction="none"
        ).tolist()
        if job["reference_logits_path"]:
            result.update(_against_reference(logits, job["reference_logits_path"]))
    logits = logits.float().cpu()
    if job["top_k"]:
        top = logits.topk(min(job["top_k"], logits.shape[-1]), dim=-1)
        result["topk_values"], result["topk_indices"] = top.values.tolist(), top.indices.tolist()
    if job["logits_path"]:
        torch.save(logits, job["logits_path"])
        result["logits_path"] = str(job["logits_path"])
    if job["kept_indices_path"]:
        kept = [
            recorder.indices[i]
            if recorder and i in recorder.indices
            else torch.arange(n).expand(layer.keys.shape[1], n).clone()
            for i, layer in enumerate(cache.layers)
        ]
        torch.save(kept, job["kept_indices_path"])
        result["kept_indices_path"] = str(job["kept_indices_path"])
    return result


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[1] == "--list":
        print(json.dumps(PRESSES, indent=2))
        return 0
    if len(argv) != 3:
        print("usage: kvpress_adapter.py JOBS.json RESULTS.json | --list", file=sys.stderr)
        return 2
    # Local model dirs only: never let a typo turn into a hub download.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import kvpress  # noqa: F401
        from transformers.utils import logging as hf_logging
    except ImportError as exc:
        print(f"kvpress is not importable here ({exc}); run inside .venvs/kvpress", file=sys.stderr)
        return 2
    hf_logging.disable_progress_bar()
    jobs = json.loads(Path(argv[1]).read_text())
    single = isinstance(jobs, dict)
    models, results = _ModelCache(), []
    for job in [jobs] if single else jobs:
        t0 = time.perf_counter()
        try:
            results.append({**run_job(job, models), "job_s": time.perf_counter() - t0})
        except Exception as exc:  # one bad job must not lose the others' results
            line = f"{type(exc).__name__}: {exc}".splitlines()[0]
            if os.environ.get("VLKV_DEBUG"):
                traceback.print_exc(file=sys.stderr)
            print(f"job {job.get('id')!r} failed: {line}", file=sys.stderr)
            results.append({"ok": False, "id": job.get("id"), "error": line})
    Path(argv[2]).write_text(json.dumps(results[0] if single else results, indent=1))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
