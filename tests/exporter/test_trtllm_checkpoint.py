from __future__ import annotations

import json

import pytest
import torch

from vlkv.exporter.errors import StageError
from vlkv.exporter.trtllm_checkpoint import (
    check_checkpoint,
    checkpoint_to_hf,
    expected_shapes,
    hf_to_trtllm,
    language_model,
    load_checkpoint,
    trtllm_config,
    write_checkpoint,
)

IDS = torch.tensor([[1, 5, 9, 17, 33, 65, 100, 3], [2, 4, 8, 16, 32, 64, 120, 7]])


def _round_trip(model, tmp_path, dtype="float32"):
    text_config, state = language_model(model)
    config = trtllm_config(text_config, dtype)
    weights = hf_to_trtllm(state, config)
    write_checkpoint(tmp_path, config, weights)
    loaded_config, loaded = load_checkpoint(tmp_path)
    return state, loaded_config, loaded, checkpoint_to_hf(loaded_config, loaded)


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_llama_round_trip_gives_identical_logits(tiny_llama, tmp_path):
    state, config, weights, rebuilt = _round_trip(tiny_llama, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "rank0.safetensors"]
    assert config["architecture"] == "LlamaForCausalLM" and config["rotary_base"] == 50000.0
    assert config["position_embedding_type"] == "rope_gpt_neox" and config["attn_bias"] is False
    torch.testing.assert_close(_logits(rebuilt), _logits(tiny_llama), atol=0, rtol=0)


def test_llama_names_and_shapes(tiny_llama, tmp_path):
    state, config, weights, _ = _round_trip(tiny_llama, tmp_path)
    # 2 layers x 7 tensors + embedding, final norm, lm_head
    assert len(weights) == 17
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected_shapes(config)
    qkv = weights["transformer.layers.1.attention.qkv.weight"]
    assert qkv.shape == ((4 + 2 * 2) * 16, 64)  # (H + 2 KVH) * head_dim, hidden
    torch.testing.assert_close(qkv[64:96], state["model.layers.1.self_attn.k_proj.weight"], atol=0, rtol=0)
    # TensorRT-LLM's naming: fc is HF's gate_proj, gate is HF's up_proj.
    torch.testing.assert_close(
        weights["transformer.layers.0.mlp.fc.weight"],
        state["model.layers.0.mlp.gate_proj.weight"],
        atol=0,
        rtol=0,
    )
    torch.testing.assert_close(
        weights["transformer.layers.0.mlp.gate.weight"],
        state["model.layers.0.mlp.up_proj.weight"],
        atol=0,
        rtol=0,
    )
    torch.testing.assert_close(
        weights["transformer.layers.0.mlp.proj.weight"],
        state["model.layers.0.mlp.down_proj.weight"],
        atol=0,
        rtol=0,
    )
    torch.testing.assert_close(
        weights["transformer.layers.0.post_layernorm.weight"],
        state["model.layers.0.post_attention_layernorm.weight"],
        atol=0,
        rtol=0,
    )


def test_qwen2_round_trip_with_qkv_bias(tiny_qwen2, tmp_path):
    state, config, weights, rebuilt = _round_trip(tiny_qwen2, tmp_path)
    assert (
        config["architecture"] == "Qwen2ForCausalLM"
        and config["qwen_type"] == "qwen2"
        and config["attn_bias"]
    )
    bias = weights["transformer.layers.0.attention.qkv.bias"]
    assert bias.shape == (128,)
    torch.testing.assert_close(bias[:64], state["model.layers.0.self_attn.q_proj.bias"], atol=0, rtol=0)
    assert bias.abs().sum() > 0
    torch.testing.assert_close(_logits(rebuilt), _logits(tiny_qwen2), atol=0, rtol=0)


def test_llava_language_model_round_trip(tiny_llava, tmp_path):
    _, config, _, rebuilt = _round_trip(tiny_llava, tmp_path)
    assert config["vocab_size"] == 128
    ids = IDS.clone()
    ids[ids == tiny_llava.config.image_token_id] = 0
    torch.testing.assert_close(_logits(rebuilt, ids), _logits(tiny_llava, ids), atol=0, rtol=0)


def test_llava_next_uses_mistral_architecture(tiny_llava_next, tmp_path):
    _, config, _, rebuilt = _round_trip(tiny_llava_next, tmp_path)
    assert config["architecture"] == "MistralForCausalLM"
    torch.testing.assert_close(_logits(rebuilt), _logits(tiny_llava_next), atol=0, rtol=0)


def test_qwen2_vl_language_model_round_trip(tiny_qwen2_vl, tmp_path):
    _, config, _, rebuilt = _round_trip(tiny_qwen2_vl, tmp_path)
    assert config["architecture"] == "Qwen2VLForConditionalGeneration" and config["qwen_type"] == "qwen2_vl"
    assert config["position_embedding_type"] == "mrope"
    assert config["rotary_scaling"] == {"type": "mrope", "mrope_section": [2, 3, 3]}
    ids = IDS % 120  # below the image / video / vision-start ids
    # Text only: M-RoPE's three position streams coincide, so Qwen2ForCausalLM must agree closely.
    torch.testing.assert_close(_logits(rebuilt, ids), _logits(tiny_qwen2_vl, ids), atol=1e-5, rtol=1e-5)


def test_dtype_is_applied(tiny_llama, tmp_path):
    _, config, weights, rebuilt = _round_trip(tiny_llama, tmp_path, dtype="float16")
    assert config["dtype"] == "float16"
    assert {w.dtype for w in weights.values()} == {torch.float16}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float16"
    # fp16 weights, fp16 compute: close to the float32 source within half-precision error.
    torch.testing.assert_close(_logits(rebuilt).float(), _logits(tiny_llama), atol=2e-2, rtol=2e-2)


def test_check_checkpoint_rejects_bad_names_and_shapes(tiny_llama):
    text_config, state = language_model(tiny_llama)
    config = trtllm_config(text_config, "float32")
    weights = hf_to_trtllm(state, config)
    broken = dict(weights)
    del broken["lm_head.weight"]
    with pytest.raises(StageError, match=r"missing \['lm_head.weight'\]"):
        check_checkpoint(config, broken)
    broken = dict(weights, **{"transformer.ln_f.weight": torch.zeros(3)})
    with pytest.raises(StageError, match=r"transformer.ln_f.weight: shape \(3,\), expected \(64,\)"):
        check_checkpoint(config, broken)


def test_unknown_language_model_type():
    from transformers import GPT2Config

    with pytest.raises(StageError, match="no TensorRT-LLM mapping for language model type 'gpt2'"):
        trtllm_config(GPT2Config(), "float32")


def test_tied_embeddings_are_written_once_each(tiny_llama, tmp_path):
    from transformers import LlamaForCausalLM

    tied = LlamaForCausalLM(
        tiny_llama.config.__class__(**{**tiny_llama.config.to_dict(), "tie_word_embeddings": True})
    )
    tied.load_state_dict(tiny_llama.state_dict(), strict=False)
    tied.tie_weights()
    _, config, weights, rebuilt = _round_trip(tied.eval(), tmp_path)
    assert config["tie_word_embeddings"] is True
    torch.testing.assert_close(
        weights["lm_head.weight"], weights["transformer.vocab_embedding.weight"], atol=0, rtol=0
    )
    torch.testing.assert_close(_logits(rebuilt), _logits(tied), atol=0, rtol=0)
