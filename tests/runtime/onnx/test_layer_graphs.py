"""The per-layer decoder graphs in ONNX Runtime against the PyTorch modules they were traced from."""

from __future__ import annotations

import onnx
import onnxruntime as ort
import pytest
import torch

from vlkv.runtime.models.adapter import make_adapter
from vlkv.runtime.onnx.layer_graphs import (
    HEAD_FILE,
    LAYER_INPUTS,
    LAYER_OUTPUTS,
    HeadGraph,
    LayerGraph,
    cached_layer_graphs,
    layer_file,
)

MODELS = ("tiny-llava", "tiny-qwen2-vl")
# float32 graph vs the same float32 PyTorch code: only summation order differs
TOL = {"atol": 5e-5, "rtol": 5e-5}
STATS_TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(scope="module")
def graphs(loaded_models):
    return {
        name: cached_layer_graphs(loaded_models[name].model, loaded_models[name].family) for name in MODELS
    }


def _feeds(adapter, batch: int, rows: int, past: int, row_sets: int, seed: int) -> dict[str, torch.Tensor]:
    """Valid layer inputs: per-(sample, head) past lengths in [0, past], right-padded rows, random row sets."""
    lay, gen = adapter.layout, torch.Generator().manual_seed(seed)
    past_len = torch.randint(0, past + 1, (batch, lay.num_kv_heads), generator=gen)
    new_len = torch.randint(1, rows + 1, (batch,), generator=gen)
    pos = past_len.max(1).values[:, None] + torch.arange(rows)[None, :]
    kv = (batch, lay.num_kv_heads, past, lay.head_dim)
    return {
        "hidden_states": torch.randn(batch, rows, adapter.text_config.hidden_size, generator=gen),
        "position_ids": pos if lay.pos_dims == 1 else pos[None].expand(3, -1, -1).contiguous(),
        "past_key": torch.randn(*kv, generator=gen),
        "past_value": torch.randn(*kv, generator=gen),
        "past_lengths": past_len,
        "new_lengths": new_len,
        "stats_rows": (torch.rand(row_sets, batch, rows, generator=gen) < 0.7).long(),
        "stats_threshold": torch.tensor([0.05, 0.2, 0.0][:row_sets]),
    }


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(("rows", "past"), [(1, 0), (1, 81), (9, 0), (9, 9), (81, 1)])
def test_layer_graphs_match_pytorch(name, rows, past, graphs, loaded_models):
    loaded = loaded_models[name]
    adapter = make_adapter(loaded.family, loaded.model, loaded.image_token_id)
    for i in (0, adapter.layout.num_layers - 1):
        feeds = _feeds(adapter, batch=3, rows=rows, past=past, row_sets=3, seed=rows + past + i)
        with torch.no_grad():
            want = LayerGraph(adapter, i).eval()(*feeds.values())
        session = ort.InferenceSession(str(graphs[name] / layer_file(i)), providers=["CPUExecutionProvider"])
        assert [x.name for x in session.get_inputs()] == list(LAYER_INPUTS)
        got = session.run(list(LAYER_OUTPUTS), {k: v.numpy() for k, v in feeds.items()})
        valid = torch.arange(rows)[None, :] < feeds["new_lengths"][:, None]
        for out, g, w in zip(LAYER_OUTPUTS, got, want):
            g = torch.from_numpy(g)
            if out == "hidden_out":
                torch.testing.assert_close(g[valid], w[valid], **TOL, msg=out)
            elif out in ("key", "value"):
                torch.testing.assert_close(g.transpose(1, 2)[valid], w.transpose(1, 2)[valid], **TOL, msg=out)
            elif out == "attn_colsum":
                assert g.shape[-1] == past + rows
                torch.testing.assert_close(g, w, **STATS_TOL, msg=out)
            else:
                assert torch.equal(g, w), out
        if past + rows > 8:
            assert int(torch.from_numpy(got[4])[1].sum()) > 0  # threshold 0.2: the counts are live


@pytest.mark.parametrize("name", MODELS)
def test_head_graph_matches_pytorch(name, graphs, loaded_models):
    loaded = loaded_models[name]
    adapter = make_adapter(loaded.family, loaded.model, loaded.image_token_id)
    hidden = torch.randn(2, 5, adapter.text_config.hidden_size, generator=torch.Generator().manual_seed(0))
    index = torch.tensor([[4, 0], [2, 2]])
    with torch.no_grad():
        want = HeadGraph(adapter).eval()(hidden, index)
    session = ort.InferenceSession(str(graphs[name] / HEAD_FILE), providers=["CPUExecutionProvider"])
    got = session.run(None, {"hidden_states": hidden.numpy(), "logits_index": index.numpy()})[0]
    torch.testing.assert_close(torch.from_numpy(got), want, **TOL)


@pytest.mark.parametrize("name", MODELS)
def test_one_softmax_per_layer_graph(name, graphs):
    """Attention and statistics read the same scores: one q·kᵀ softmax per layer graph."""
    model = onnx.load(str(graphs[name] / layer_file(0)), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Softmax") == 1 and "Exp" not in ops
    assert {o.domain for o in model.opset_import} == {""}  # plain ONNX only: runs in stock ORT
