"""Chunked statistics from the runtime equal those of an eager full attention matrix (GQA included)."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.policies.reference import eager_attentions
from vlkv.runtime.backend import StatsRequest, StepInputs
from vlkv.runtime.prompt import Prompt

ATOL, RTOL = 1e-5, 1e-4  # float32 softmax sums over <= ~100 rows


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
@pytest.mark.parametrize("rows", ["all", "last5"])
def test_chunked_stats_equal_eager(name, rows, engines, loaded_models, images):
    engine = engines[name]
    batch = engine.encode([Prompt("Count the red squares in this picture.", [images[0]])])
    n = int(batch.lengths[0])
    emb = engine.backend.embed(batch)
    row_mask = None
    if rows == "last5":
        row_mask = torch.arange(n)[None, :] >= n - 5
    cache = engine.new_cache(batch)
    out = engine.backend.step(
        StepInputs(batch.input_ids, batch.positions, batch.modality, batch.lengths, emb),
        cache,
        StatsRequest(rows=row_mask, threshold=0.01),
    )
    eager = eager_attentions(loaded_models[name], emb, batch.positions)
    heads, kv_heads = engine.backend.num_heads, engine.backend.num_kv_heads
    assert heads > kv_heads, "tiny models are meant to exercise GQA"
    for layer, (st, att) in enumerate(zip(out.stats, eager)):
        att = att.float()
        sel = att if row_mask is None else att[:, :, -5:]
        torch.testing.assert_close(
            st.colsum[:, :, :n], sel.sum(2), atol=ATOL, rtol=RTOL, msg=f"layer {layer}"
        )
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
        vis = causal if row_mask is None else causal[-5:]
        rowmax = sel.amax(-1, keepdim=True)
        below = ((sel < 0.01 * rowmax) & vis).sum((-1, -2))
        assert torch.equal(st.visible, vis.sum().expand_as(st.visible))
        assert torch.equal(st.below, below)
