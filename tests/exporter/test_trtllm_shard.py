"""Tensor/pipeline-parallel TensorRT-LLM checkpoints: shards re-assemble to the Hugging Face weights exactly."""

from __future__ import annotations

import json
import shlex

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from vlkv.exporter import trtllm_checkpoint, trtllm_engine
from vlkv.exporter.errors import StageError, StageSkipped
from vlkv.exporter.recipe_loader import RecipeError, load_recipe
from vlkv.exporter.trtllm_checkpoint import (
    checkpoint_to_hf,
    hf_to_trtllm,
    language_model,
    load_checkpoint,
    trtllm_config,
    write_checkpoint,
)
from vlkv.exporter.trtllm_shard import (
    assemble,
    expected_rank_shapes,
    pp_layers,
    shard,
    sharded_config,
)

# 5 layers: pp = 2 and 3 split unevenly; a vocabulary of 130 is padded for tp = 4.
TEXT = dict(
    vocab_size=130,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=5,
    num_attention_heads=4,
    max_position_embeddings=128,
)


def _seeded(build, seed):
    torch.manual_seed(seed)
    model = build()
    with torch.no_grad():  # HF zero-initialises biases and norms to 1: randomise so every copy is observable
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0, 0.5)
    return model.eval()


MODELS = {
    # GQA: 2 K/V heads, split for tp = 2 and copied for tp = 4
    "gqa": lambda: _seeded(lambda: LlamaForCausalLM(LlamaConfig(**TEXT, num_key_value_heads=2)), 11),
    # MHA with q/k/v biases (Qwen2)
    "mha": lambda: _seeded(lambda: Qwen2ForCausalLM(Qwen2Config(**TEXT, num_key_value_heads=4)), 12),
    # one K/V head (MQA): copied to every tp rank
    "mqa": lambda: _seeded(lambda: LlamaForCausalLM(LlamaConfig(**TEXT, num_key_value_heads=1)), 13),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def source(request):
    model = MODELS[request.param]()
    text_config, state = language_model(model)
    config = trtllm_config(text_config, "float32")
    return request.param, model, state, config, hf_to_trtllm(state, config)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("pp", [1, 2, 3])
def test_shards_reassemble_to_the_hf_weights_exactly(source, tp, pp, tmp_path):
    _, model, state, config, weights = source
    config = sharded_config(config, tp, pp)
    write_checkpoint(tmp_path, config, weights)
    files = sorted(p.name for p in tmp_path.glob("rank*.safetensors"))
    assert files == sorted(f"rank{r}.safetensors" for r in range(tp * pp))
    assert json.loads((tmp_path / "config.json").read_text())["mapping"] == {
        "world_size": tp * pp,
        "tp_size": tp,
        "pp_size": pp,
    }
    loaded_config, loaded = load_checkpoint(tmp_path)
    assert sorted(loaded) == sorted(weights)
    for name, w in weights.items():
        assert torch.equal(loaded[name], w), name
    rebuilt = checkpoint_to_hf(loaded_config, loaded).state_dict()
    for name, w in state.items():
        assert torch.equal(rebuilt[name], w), name


@pytest.mark.parametrize("tp,pp", [(2, 3), (4, 2)])
def test_rank_layout_follows_tensorrt_llm(source, tp, pp):
    kind, _, _, config, weights = source
    config = sharded_config(config, tp, pp)
    ranks = shard(config, weights, tp, pp)
    split = [pp_layers(5, pp, r) for r in range(pp)]
    assert [len(s) for s in split] == ([2, 2, 1] if pp == 3 else [3, 2])  # the first L mod pp stages: +1
    assert sum(split, []) == list(range(5))
    for rank, tensors in enumerate(ranks):
        tp_rank, pp_rank = rank % tp, rank // tp
        assert {n: tuple(t.shape) for n, t in tensors.items()} == expected_rank_shapes(config, rank)
        assert ("transformer.vocab_embedding.weight" in tensors) == (pp_rank == 0)
        assert ("lm_head.weight" in tensors) == (pp_rank == pp - 1)
        # a stage's layers are renumbered from 0 and are the global layers pp_layers names
        first = split[pp_rank][0]
        want = weights[f"transformer.layers.{first}.mlp.fc.weight"].chunk(tp, dim=0)[tp_rank]
        assert torch.equal(tensors["transformer.layers.0.mlp.fc.weight"], want)
        want = weights[f"transformer.layers.{first}.attention.dense.weight"].chunk(tp, dim=1)[tp_rank]
        assert torch.equal(tensors["transformer.layers.0.attention.dense.weight"], want)


def test_kv_heads_are_copied_when_fewer_than_tp_ranks(source):
    kind, _, _, config, weights = source
    kv, d, heads = config["num_key_value_heads"], config["head_size"], config["num_attention_heads"]
    tp = 4
    ranks = shard(sharded_config(config, tp, 1), weights, tp, 1)
    full = weights["transformer.layers.0.attention.qkv.weight"]
    k_full = full[heads * d : (heads + kv) * d]
    for rank, tensors in enumerate(ranks):
        qkv = tensors["transformer.layers.0.attention.qkv.weight"]
        local_kv = max(kv // tp, 1)
        assert qkv.shape[0] == (heads // tp + 2 * local_kv) * d
        k = qkv[heads // tp * d : (heads // tp + local_kv) * d]
        # rank r's query heads r·H/tp … read K/V head (r·H/tp) // (H/kv): that head must be here
        group = (rank * heads // tp) // (heads // kv)
        assert torch.equal(k[:d], k_full[group * d : (group + 1) * d])


def test_a_damaged_copy_or_padding_is_refused(source):
    kind, _, _, config, weights = source
    config = sharded_config(config, 4, 1)
    ranks = shard(config, weights, 4, 1)
    bad = [dict(r) for r in ranks]
    bad[1]["transformer.layers.0.input_layernorm.weight"] = (
        bad[1]["transformer.layers.0.input_layernorm.weight"] + 1
    )
    with pytest.raises(StageError, match="replicated copies differ"):
        assemble(config, bad)
    bad = [dict(r) for r in ranks]
    bad[3]["lm_head.weight"] = bad[3]["lm_head.weight"].clone()
    bad[3]["lm_head.weight"][-1] = 1.0  # 130 → 132 rows: the last two are padding
    with pytest.raises(StageError, match="padding rows are not zero"):
        assemble(config, bad)
    if config["num_key_value_heads"] < 4:
        bad = [dict(r) for r in ranks]
        qkv = bad[0]["transformer.layers.1.attention.qkv.weight"].clone()
        qkv[-1] += 1  # the V copy of rank 0 no longer equals rank 1's
        bad[0]["transformer.layers.1.attention.qkv.weight"] = qkv
        with pytest.raises(StageError, match="replicated copies differ"):
            assemble(config, bad)


def test_missing_or_misshapen_rank_file_is_one_line(source, tmp_path):
    _, _, _, config, weights = source
    config = sharded_config(config, 2, 2)
    write_checkpoint(tmp_path, config, weights)
    (tmp_path / "rank3.safetensors").unlink()
    with pytest.raises(StageError, match="missing rank3.safetensors"):
        load_checkpoint(tmp_path)
    write_checkpoint(tmp_path, config, weights)
    tensors = load_file(str(tmp_path / "rank1.safetensors"))
    tensors["transformer.layers.0.mlp.fc.weight"] = tensors["transformer.layers.0.mlp.fc.weight"][:-1].clone()
    save_file(tensors, str(tmp_path / "rank1.safetensors"))
    with pytest.raises(StageError, match=r"^rank1: transformer.layers.0.mlp.fc.weight: shape"):
        load_checkpoint(tmp_path)


def test_rewriting_with_fewer_ranks_leaves_no_stale_files(source, tmp_path):
    _, _, _, config, weights = source
    write_checkpoint(tmp_path, sharded_config(config, 2, 2), weights)
    write_checkpoint(tmp_path, sharded_config(config, 1, 1), weights)
    assert [p.name for p in tmp_path.glob("rank*.safetensors")] == ["rank0.safetensors"]


@pytest.mark.parametrize(
    "tp,pp,message",
    [
        (3, 1, "trtllm.tp_size: 3 does not divide num_attention_heads=4"),
        (1, 6, "trtllm.pp_size: 6 pipeline stages for num_hidden_layers=5"),
        (0, 1, "trtllm.tp_size: must be >= 1"),
    ],
)
def test_impossible_splits_name_the_field(source, tp, pp, message):
    _, _, _, config, _ = source
    with pytest.raises(StageError) as info:
        sharded_config(config, tp, pp)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_kv_heads_that_do_not_divide_tp_are_refused():
    config = {
        "num_attention_heads": 12,
        "num_key_value_heads": 3,
        "num_hidden_layers": 2,
        "intermediate_size": 96,
    }
    with pytest.raises(StageError, match="num_key_value_heads=3 must divide one another"):
        sharded_config(config, 4, 1)


@pytest.mark.parametrize(
    "override,field",
    [("trtllm.tp_size=0", "tp_size"), ("trtllm.pp_size=-1", "pp_size"), ("trtllm.flow=legacy", "flow")],
)
def test_recipe_validates_parallelism(override, field):
    with pytest.raises(RecipeError) as info:
        load_recipe(None, ["model.name_or_path=tiny-llava", override])
    assert field in str(info.value) and "\n" not in str(info.value)


def test_recipe_sharded_checkpoint_stage(tmp_path):
    recipe = load_recipe(None, ["model.name_or_path=tiny-llava", "trtllm.tp_size=2", "trtllm.pp_size=2"])
    out = tmp_path / "trtllm_checkpoint"
    out.mkdir()
    trtllm_checkpoint.run(recipe, tmp_path, out)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["ranks"] == 4
    assert metrics["round_trip_max_abs_err"] == 0.0  # re-assembled shards give the source's logits
    assert len(list(out.glob("rank*.safetensors"))) == 4


def test_serve_flow_hands_the_hf_checkpoint_to_trtllm_serve(tmp_path, monkeypatch):
    recipe = load_recipe(
        None, ["model.name_or_path=tiny-llava", "trtllm.flow=serve", "trtllm.tp_size=2", "trtllm.pp_size=2"]
    )
    ckpt = tmp_path / "trtllm_checkpoint"
    ckpt.mkdir()
    trtllm_checkpoint.run(recipe, tmp_path, ckpt)
    hf_dir = json.loads((ckpt / "hf_checkpoint.json").read_text())["hf_dir"]
    assert (ckpt / "hf" / "config.json").is_file() and hf_dir == str((ckpt / "hf").resolve())
    assert not list(ckpt.glob("rank*.safetensors"))  # no legacy checkpoint in this flow
    out = tmp_path / "trtllm_engine"
    monkeypatch.setattr(trtllm_engine.shutil, "which", lambda name: None)
    with pytest.raises(StageSkipped) as info:
        trtllm_engine.run(recipe, tmp_path, out)
    assert str(info.value).startswith("trtllm-serve is not installed; skipped trtllm_engine")
    command = json.loads((out / "serve_command.json").read_text())
    assert shlex.split((out / "serve_command.sh").read_text().splitlines()[-1]) == ["exec", *command]
    assert command[:2] == ["trtllm-serve", hf_dir]
    args = dict(zip(command[2::2], command[3::2]))
    assert args["--tp_size"] == "2" and args["--pp_size"] == "2"
    assert args["--max_seq_len"] == str(recipe.trtllm.max_seq_len)


def test_serve_flow_refuses_an_impossible_split_before_any_gpu(tmp_path):
    recipe = load_recipe(None, ["model.name_or_path=tiny-llava", "trtllm.flow=serve", "trtllm.tp_size=3"])
    with pytest.raises(StageError, match="trtllm.tp_size: 3 does not divide"):
        trtllm_checkpoint.run(recipe, tmp_path, tmp_path)
