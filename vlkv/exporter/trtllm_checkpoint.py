"""Stage ``trtllm_checkpoint``: the VLM's language model → a TensorRT-LLM checkpoint, and back.

A checkpoint is ``config.json`` + ``rank{N}.safetensors`` for each of its ``tp_size × pp_size`` ranks
(:mod:`vlkv.exporter.trtllm_shard` splits and re-assembles them), with the names TensorRT-LLM's
LLaMA and Qwen converters write (toolchain.md B2); single-rank names::

    transformer.vocab_embedding.weight             ← model.embed_tokens
    transformer.layers.{i}.input_layernorm.weight  ← input_layernorm
    transformer.layers.{i}.attention.qkv.weight    ← cat(q_proj, k_proj, v_proj) on the output dim
    transformer.layers.{i}.attention.qkv.bias      ← cat of the q/k/v biases (Qwen2 only)
    transformer.layers.{i}.attention.dense.weight  ← o_proj
    transformer.layers.{i}.post_layernorm.weight   ← post_attention_layernorm
    transformer.layers.{i}.mlp.fc.weight           ← gate_proj   (sic: fc is the gate)
    transformer.layers.{i}.mlp.gate.weight         ← up_proj     (sic: gate is the up projection)
    transformer.layers.{i}.mlp.proj.weight         ← down_proj
    transformer.ln_f.weight                        ← model.norm
    lm_head.weight                                 ← lm_head (written even when tied)

Writing needs no ``tensorrt_llm``. :func:`checkpoint_to_hf` is the inverse, used to prove the mapping
by comparing logits. This layout is what ``trtllm-build`` reads, i.e. TensorRT-LLM ≤ 1.2; later
releases load the Hugging Face checkpoint directly (``trtllm.flow: serve``, see docs/trtllm.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import PretrainedConfig, PreTrainedModel

from vlkv.exporter.errors import StageError
from vlkv.exporter.recipe import Recipe
from vlkv.exporter.source import TORCH_DTYPES, load_source_model
from vlkv.exporter.trtllm_shard import assemble, expected_rank_shapes, shard, sharded_config

# HF text model_type → (TensorRT-LLM architecture, HF causal-LM class for the inverse, qwen_type).
ARCHITECTURES: dict[str, tuple[str, str, str | None]] = {
    "llama": ("LlamaForCausalLM", "LlamaForCausalLM", None),
    "mistral": ("MistralForCausalLM", "MistralForCausalLM", None),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2ForCausalLM", "qwen2"),
    "qwen2_vl_text": ("Qwen2VLForConditionalGeneration", "Qwen2ForCausalLM", "qwen2_vl"),
}
# Logits are compared after a round trip only below this size: a second copy of a 7B model does not fit.
ROUND_TRIP_MAX_PARAMS = 500_000_000
_LAYER_MAP = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_layernorm.weight": "post_attention_layernorm.weight",
    "attention.dense.weight": "self_attn.o_proj.weight",
    "mlp.fc.weight": "mlp.gate_proj.weight",
    "mlp.gate.weight": "mlp.up_proj.weight",
    "mlp.proj.weight": "mlp.down_proj.weight",
}


def language_model(model: PreTrainedModel) -> tuple[PretrainedConfig, dict[str, torch.Tensor]]:
    """The text config and HF causal-LM state dict (``model.*`` + ``lm_head.weight``) of a VLM or LM."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "language_model"):
        state = {f"model.{k}": v for k, v in inner.language_model.state_dict().items()}
        state["lm_head.weight"] = model.lm_head.weight
        return model.config.get_text_config(), state
    return model.config, dict(model.state_dict())


def _rope(text_config: PretrainedConfig) -> tuple[float, dict | None]:
    params = dict(getattr(text_config, "rope_parameters", None) or {})
    base = float(params.pop("rope_theta", getattr(text_config, "rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", "default")
    section = params.pop("mrope_section", None)
    if section is not None:
        return base, {"type": "mrope", "mrope_section": list(section)}
    return base, None if rope_type == "default" else {"type": rope_type, **params}


def trtllm_config(text_config: PretrainedConfig, dtype: str) -> dict:
    """TensorRT-LLM ``config.json`` for a Llama / Mistral / Qwen2 / Qwen2-VL text config."""
    if text_config.model_type not in ARCHITECTURES:
        raise StageError(f"no TensorRT-LLM mapping for language model type {text_config.model_type!r}")
    arch, _, qwen_type = ARCHITECTURES[text_config.model_type]
    heads = text_config.num_attention_heads
    head_size = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    base, scaling = _rope(text_config)
    config = {
        "architecture": arch,
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": text_config.vocab_size,
        "max_position_embeddings": text_config.max_position_embeddings,
        "hidden_size": text_config.hidden_size,
        "num_hidden_layers": text_config.num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(text_config, "num_key_value_heads", None) or heads,
        "head_size": head_size,
        "hidden_act": text_config.hidden_act,
        "intermediate_size": text_config.intermediate_size,
        "norm_epsilon": text_config.rms_norm_eps,
        "position_embedding_type": "mrope" if qwen_type == "qwen2_vl" else "rope_gpt_neox",
        "rotary_base": base,
        "rotary_scaling": scaling,
        "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "tie_word_embeddings": bool(getattr(text_config, "tie_word_embeddings", False)),
        "attn_bias": qwen_type is not None,
        "mlp_bias": False,
    }
    if qwen_type is not None:
        config["qwen_type"] = qwen_type
        config["rotary_embedding_dim"] = head_size
    return config


def hf_to_trtllm(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """Rename/concatenate an HF causal-LM state dict into TensorRT-LLM weights in ``config['dtype']``."""
    dtype = TORCH_DTYPES[config["dtype"]]
    out = {
        "transformer.vocab_embedding.weight": state["model.embed_tokens.weight"],
        "transformer.ln_f.weight": state["model.norm.weight"],
        "lm_head.weight": state.get("lm_head.weight", state["model.embed_tokens.weight"]),
    }
    for i in range(config["num_hidden_layers"]):
        src, dst = f"model.layers.{i}.", f"transformer.layers.{i}."
        qkv = [state[f"{src}self_attn.{p}_proj.weight"] for p in "qkv"]
        out[f"{dst}attention.qkv.weight"] = torch.cat(qkv, dim=0)
        if config["attn_bias"]:
            out[f"{dst}attention.qkv.bias"] = torch.cat(
                [state[f"{src}self_attn.{p}_proj.bias"] for p in "qkv"]
            )
        for trt_name, hf_name in _LAYER_MAP.items():
            out[dst + trt_name] = state[src + hf_name]
    # Views of the model's own parameters are kept (no second copy of a 7B model); only tensors that
    # share storage with another entry (tied embeddings) are cloned, which safetensors requires.
    weights, seen = {}, set()
    for name, tensor in out.items():
        tensor = tensor.detach().to(dtype).contiguous()
        if tensor.untyped_storage().data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        weights[name] = tensor
    return weights


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every weight name with its shape, from the config alone (used to validate a checkpoint)."""
    h, d = config["hidden_size"], config["head_size"]
    qkv = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * d
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    shapes = {
        "transformer.vocab_embedding.weight": (vocab, h),
        "transformer.ln_f.weight": (h,),
        "lm_head.weight": (vocab, h),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"transformer.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_layernorm.weight": (h,),
            p + "attention.qkv.weight": (qkv, h),
            p + "attention.dense.weight": (h, config["num_attention_heads"] * d),
            p + "mlp.fc.weight": (inter, h),
            p + "mlp.gate.weight": (inter, h),
            p + "mlp.proj.weight": (h, inter),
        }
        if config["attn_bias"]:
            shapes[p + "attention.qkv.bias"] = (qkv,)
    return shapes


def write_checkpoint(out_dir: Path, config: dict, weights: dict[str, torch.Tensor]) -> None:
    """Write ``config.json`` and one ``rank{N}.safetensors`` per rank of ``config['mapping']``.

    ``weights`` are the single-rank weights of :func:`hf_to_trtllm`; they are split here.
    """
    check_checkpoint({**config, "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1}}, weights)
    m = config.get("mapping") or {}
    tp, pp = int(m.get("tp_size", 1)), int(m.get("pp_size", 1))
    ranks = [weights] if tp * pp == 1 else shard(config, weights, tp, pp)
    for rank, tensors in enumerate(ranks):
        check_checkpoint(config, tensors, rank)
    for stale in out_dir.glob("rank*.safetensors"):  # a rebuild with fewer ranks
        stale.unlink()
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for rank, tensors in enumerate(ranks):
        save_file(tensors, str(out_dir / f"rank{rank}.safetensors"))


def check_checkpoint(config: dict, weights: dict[str, torch.Tensor], rank: int = 0) -> None:
    """Raise StageError (one line) unless names and shapes are exactly those rank ``rank`` must hold."""
    m = config.get("mapping") or {}
    single = int(m.get("tp_size", 1)) * int(m.get("pp_size", 1)) == 1
    expected = expected_shapes(config) if single else expected_rank_shapes(config, rank)
    where = "" if single else f"rank{rank}: "
    missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or extra:
        raise StageError(f"{where}checkpoint names differ: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise StageError(f"{where}{name}: shape {tuple(weights[name].shape)}, expected {shape}")


def load_checkpoint(ckpt_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config, weights)`` of a checkpoint directory; several ranks are re-assembled into one."""
    ckpt_dir = Path(ckpt_dir)
    config = json.loads((ckpt_dir / "config.json").read_text())
    m = config.get("mapping") or {}
    world = int(m.get("tp_size", 1)) * int(m.get("pp_size", 1))
    files = [ckpt_dir / f"rank{r}.safetensors" for r in range(world)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise StageError(f"{ckpt_dir}: missing {', '.join(missing)} for mapping tp×pp = {world}")
    ranks = [load_file(str(f)) for f in files]
    for rank, tensors in enumerate(ranks):
        check_checkpoint(config, tensors, rank)
    if world == 1:
        return config, ranks[0]
    return config, assemble(config, ranks)


def checkpoint_to_hf(config: dict, weights: dict[str, torch.Tensor]) -> PreTrainedModel:
    """The inverse mapping: an HF causal LM (Qwen2-VL's text model becomes a ``Qwen2ForCausalLM``,
    which equals it on text-only input, where M-RoPE's three position streams coincide)."""
    import transformers

    model_type = next(k for k, v in ARCHITECTURES.items() if v[0] == config["architecture"])
    hf_class = getattr(transformers, ARCHITECTURES[model_type][1])
    rope = {"rope_type": "default", "rope_theta": config["rotary_base"]}
    scaling = config.get("rotary_scaling") or {}
    if scaling and scaling.get("type") != "mrope":
        rope = {
            "rope_theta": config["rotary_base"],
            "rope_type": scaling["type"],
            **{k: v for k, v in scaling.items() if k != "type"},
        }
    hf_config = hf_class.config_class(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_size"],
        hidden_act=config["hidden_act"],
        max_position_embeddings=config["max_position_embeddings"],
        rms_norm_eps=config["norm_epsilon"],
        rope_parameters=rope,
        tie_word_embeddings=config["tie_word_embeddings"],
    )
    state = {
        "model.embed_tokens.weight": weights["transformer.vocab_embedding.weight"],
        "model.norm.weight": weights["transformer.ln_f.weight"],
        "lm_head.weight": weights["lm_head.weight"],
    }
    sizes = [config["num_attention_heads"] * config["head_size"]] + [
        config["num_key_value_heads"] * config["head_size"]
    ] * 2
    for i in range(config["num_hidden_layers"]):
        src, dst = f"transformer.layers.{i}.", f"model.layers.{i}."
        for p, w in zip("qkv", weights[f"{src}attention.qkv.weight"].split(sizes, dim=0)):
            state[f"{dst}self_attn.{p}_proj.weight"] = w
        if config["attn_bias"]:
            for p, b in zip("qkv", weights[f"{src}attention.qkv.bias"].split(sizes)):
                state[f"{dst}self_attn.{p}_proj.bias"] = b
        for trt_name, hf_name in _LAYER_MAP.items():
            state[dst + hf_name] = weights[src + trt_name]
    dtype = TORCH_DTYPES[config["dtype"]]
    model = hf_class(hf_config).to(dtype).eval()
    model.load_state_dict(state, strict=True)
    return model


def run(recipe: Recipe, src_dir: Path, out_dir: Path) -> Path:
    """Stage entry point: write the checkpoint, re-check names/shapes, and (small models) logits.

    With ``trtllm.flow: serve`` the checkpoint is the Hugging Face one (:func:`hf_checkpoint`).
    """
    if recipe.trtllm.flow == "serve":
        return hf_checkpoint(recipe, out_dir)
    model = load_source_model(recipe.model)
    text_config, state = language_model(model)
    config = sharded_config(
        trtllm_config(text_config, recipe.model.dtype), recipe.trtllm.tp_size, recipe.trtllm.pp_size
    )
    weights = hf_to_trtllm(state, config)
    write_checkpoint(out_dir, config, weights)
    metrics = {
        "tensors": len(weights),
        "parameters": sum(w.numel() for w in weights.values()),
        "ranks": config["mapping"]["world_size"],
    }
    if metrics["parameters"] <= ROUND_TRIP_MAX_PARAMS:
        metrics["round_trip_max_abs_err"] = round_trip_error(model, out_dir)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return out_dir


def round_trip_error(model: PreTrainedModel, ckpt_dir: Path, seq: int = 12, seed: int = 0) -> float:
    """max |logits(source) - logits(checkpoint → HF)| on seeded text-only token ids (1, seq)."""
    rebuilt = checkpoint_to_hf(*load_checkpoint(ckpt_dir))
    vocab = rebuilt.config.vocab_size
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seed))
    # Image/video placeholder ids would make the VLM expect pixels; text-only ids exercise the LM alone.
    special = [v for k, v in model.config.to_dict().items() if k.endswith("token_id") and isinstance(v, int)]
    ids[torch.isin(ids, torch.tensor(special, dtype=ids.dtype))] = 0
    with torch.no_grad():
        want = model(input_ids=ids).logits.float()
        got = rebuilt(input_ids=ids).logits.float()
    return float((want - got).abs().max())


def hf_checkpoint(recipe: Recipe, out_dir: Path) -> Path:
    """Where ``trtllm-serve`` finds the Hugging Face checkpoint, recorded in ``hf_checkpoint.json``.

    A local checkpoint directory is referenced where it is (no copy of a 7B model); a built-in model
    exists only in code, so it is saved under ``out_dir/hf``. The tensor/pipeline split is checked
    here, before any GPU is involved, with the same rules the legacy flow uses.
    """
    model = load_source_model(recipe.model)
    text_config, _ = language_model(model)
    sharded_config(
        trtllm_config(text_config, recipe.model.dtype), recipe.trtllm.tp_size, recipe.trtllm.pp_size
    )
    if recipe.model.is_builtin:
        hf_dir = out_dir / "hf"
        model.save_pretrained(hf_dir)
    else:
        hf_dir = Path(recipe.model.name_or_path)
    info = {
        "hf_dir": str(hf_dir.resolve()),
        "tp_size": recipe.trtllm.tp_size,
        "pp_size": recipe.trtllm.pp_size,
    }
    (out_dir / "hf_checkpoint.json").write_text(json.dumps(info, indent=2) + "\n")
    return out_dir
