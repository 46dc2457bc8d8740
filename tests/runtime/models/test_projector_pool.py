"""The pooling projector: a file with ``token_pool`` installs it and emits exactly the plain MLP of the
2x2 block means (a quarter of the tokens); the processor is matched to that count; a file without it
loads exactly as before; bad pools are one line; the ONNX vision export carries the pooling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

from tests.runtime.models.test_projector_position import (
    _features,
    _images,
    _onnx_vision_tokens,
    _plain_again,
    _state,
)
from vlkv.runtime.models import smollm2_llava as S
from vlkv.runtime.models.projector_order import ORDER_KEY, column_major
from vlkv.runtime.models.projector_pool import (
    POOL_KEY,
    PooledProjector,
    check_pool,
    match_processor,
    pool_patches,
)
from vlkv.runtime.models.projector_position import install

PATCHES = 16  # tiny-llava: 56 px, patch 14, a 4x4 raster -> 2x2 pooled
POOL = torch.tensor(2)


def _reference(model, images: torch.Tensor) -> torch.Tensor:
    """Pool then MLP, written out: the vision features the projector gets, 2x2 block means by hand."""
    captured = []
    proj = model.model.multi_modal_projector
    hook = proj.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    with torch.no_grad():
        model.model.get_image_features(pixel_values=images)
        hook.remove()
        grid = captured[0].reshape(2, 4, 4, -1)  # (images, rows, cols, d)
        blocks = [grid[:, r : r + 2, c : c + 2].mean(dim=(1, 2)) for r in (0, 2) for c in (0, 2)]
        x = torch.stack(blocks, dim=1)  # (images, 4, d), row-major blocks
        return proj.linear_2(proj.act(proj.linear_1(x)))


def test_pool_patches_takes_block_means_row_major():
    x = torch.arange(16.0).reshape(1, 16, 1)  # patch p holds p
    # blocks (rows 0-1, cols 0-1) = {0, 1, 4, 5}, then cols 2-3, then rows 2-3
    assert pool_patches(x, 2).flatten().tolist() == [2.5, 4.5, 10.5, 12.5]
    assert torch.equal(pool_patches(x, 1), x)
    with pytest.raises(ValueError, match="square raster of side divisible"):
        pool_patches(torch.zeros(1, 12, 1), 2)


def test_a_file_with_the_pool_emits_the_mlp_of_block_means(tiny, monkeypatch):
    monkeypatch.setattr(S, "NUM_IMAGE_TOKENS", PATCHES)
    state = _state(tiny.model, 3)
    S.apply_projector(tiny.model, state)
    images = _images(4)
    plain = _features(tiny.model, images)
    ids = torch.tensor([[1, 5, 9, 17, 3]])
    with torch.no_grad():
        text_logits = tiny.model(input_ids=ids).logits
    S.apply_projector(tiny.model, state | {POOL_KEY: POOL})
    proj = tiny.model.model.multi_modal_projector
    assert isinstance(proj, PooledProjector) and proj.pool_factor == 2
    pooled = _features(tiny.model, images)
    assert pooled.shape == (2, PATCHES // 4, plain.shape[-1])
    torch.testing.assert_close(pooled, _reference(tiny.model, images), rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(tiny.model(input_ids=ids).logits, text_logits, rtol=0, atol=0)
    # a file without the pool afterwards puts the plain MLP back
    _plain_again(tiny.model, state, images, plain)


def test_the_processor_expands_each_image_to_the_pooled_tokens(tiny, monkeypatch):
    monkeypatch.setattr(S, "NUM_IMAGE_TOKENS", PATCHES)
    state = _state(tiny.model, 5)

    def image_tokens() -> int:
        inputs = tiny.processor(
            text=tiny.prompt_template("hi", 2), images=[Image.new("RGB", (56, 56))] * 2, return_tensors="pt"
        )
        return int((inputs["input_ids"] == tiny.image_token_id).sum())

    assert image_tokens() == 2 * PATCHES
    S.apply_projector(tiny.model, state | {POOL_KEY: POOL})
    match_processor(tiny.processor, tiny.model)
    assert image_tokens() == 2 * PATCHES // 4
    # the whole model runs a pooled prompt: its image tokens take the pooled features
    inputs = tiny.processor(
        text=tiny.prompt_template("hi", 1), images=[Image.new("RGB", (56, 56))], return_tensors="pt"
    )
    with torch.no_grad():
        assert tiny.model(**inputs).logits.shape[1] == inputs["input_ids"].shape[1]
    S.apply_projector(tiny.model, state)
    match_processor(tiny.processor, tiny.model)
    assert image_tokens() == 2 * PATCHES


def test_bad_pools_are_one_line(tiny, monkeypatch):
    monkeypatch.setattr(S, "NUM_IMAGE_TOKENS", PATCHES)
    state = _state(tiny.model, 6)
    cases = {
        "token_pool must be one of [1, 2], got 3": torch.tensor(3),
        "token_pool must be one integer": torch.tensor(2.0),
        "token_pool must be one integer, got torch.int64 (2,)": torch.tensor([2, 2]),
    }
    for message, pool in cases.items():
        with pytest.raises(ValueError) as err:
            S.apply_projector(tiny.model, state | {POOL_KEY: pool})
        assert "\n" not in str(err.value) and message in str(err.value)
    assert type(tiny.model.model.multi_modal_projector) is LlavaMultiModalProjector  # left as it was
    with pytest.raises(ValueError, match="side divisible by it, got 9 patches"):
        check_pool(2, 9)
    with pytest.raises(ValueError, match="not several"):
        S.apply_projector(tiny.model, state | {POOL_KEY: POOL, ORDER_KEY: column_major(PATCHES)})


def test_a_file_holding_the_pool_passes_the_checksum_and_key_checks(tmp_path):
    from safetensors.torch import save_file

    state = {k: torch.zeros(s) for k, s in [("linear_1.weight", (4, 2)), ("linear_1.bias", (4,))]}
    state |= {"linear_2.weight": torch.zeros(4, 4), "linear_2.bias": torch.zeros(4)}
    path = tmp_path / "pooled.safetensors"
    save_file(state | {POOL_KEY: POOL}, path)
    loaded = S.load_projector(path, sha256=S._sha256(path))
    assert set(loaded) == S.PROJECTOR_KEYS | {POOL_KEY}
    assert loaded[POOL_KEY].dtype == torch.int64 and int(loaded[POOL_KEY]) == 2


def test_install_keeps_the_callers_random_state(tiny):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    install(tiny.model, _state(tiny.model, 7) | {POOL_KEY: POOL})
    assert torch.equal(torch.rand(3), expected)


def test_the_onnx_vision_export_carries_the_pooling(tiny, tmp_path):
    install(tiny.model, _state(tiny.model, 9) | {POOL_KEY: POOL})
    got, images = _onnx_vision_tokens(tiny.model, tmp_path)
    assert got.shape == (2, PATCHES // 4, tiny.model.config.text_config.hidden_size)
    np.testing.assert_allclose(got, _features(tiny.model, images).numpy(), rtol=1e-5, atol=1e-5)
