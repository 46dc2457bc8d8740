"""The token-reordering projector: a file with ``token_order`` installs it and emits exactly the plain
MLP's tokens in that order; a file without it loads exactly as before; bad orders are one line; the
ONNX vision export carries the order."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

from tests.runtime.models.test_projector_position import (
    _features,
    _images,
    _onnx_vision_tokens,
    _plain_again,
    _state,
)
from vlkv.runtime.models import smollm2_llava as S
from vlkv.runtime.models.projector_order import ORDER_KEY, OrderedProjector, column_major, order_for
from vlkv.runtime.models.projector_position import POSITION_KEY, install

PATCHES = 16  # tiny-llava: 56 px, patch 14, a 4x4 raster


def test_column_major_runs_down_each_column_left_to_right():
    order = column_major(16)
    # patch p = row * 4 + col; token j = col * 4 + row
    assert order.tolist() == [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15]
    big = column_major(256)
    assert big[:16].tolist() == [16 * r for r in range(16)]  # the leftmost column first, top to bottom
    assert big[-1].item() == 255 and sorted(big.tolist()) == list(range(256))
    assert order_for("raster", 16) is None
    with pytest.raises(ValueError, match="square patch raster, got 15"):
        column_major(15)
    with pytest.raises(ValueError, match="token order must be one of"):
        order_for("rows", 16)


def test_a_file_with_the_order_emits_the_plain_tokens_reordered(tiny, monkeypatch):
    monkeypatch.setattr(S, "NUM_IMAGE_TOKENS", PATCHES)
    state = _state(tiny.model, 3)
    S.apply_projector(tiny.model, state)
    plain_module = tiny.model.model.multi_modal_projector
    images = _images(4)
    plain = _features(tiny.model, images)
    ids = torch.tensor([[1, 5, 9, 17, 3]])
    with torch.no_grad():
        text_logits = tiny.model(input_ids=ids).logits
    order = column_major(PATCHES)
    S.apply_projector(tiny.model, state | {ORDER_KEY: order})
    assert isinstance(tiny.model.model.multi_modal_projector, OrderedProjector)
    # the same MLP, bit for bit, on every image's patch order[j] at token j
    torch.testing.assert_close(_features(tiny.model, images), plain[:, order], rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(tiny.model(input_ids=ids).logits, text_logits, rtol=0, atol=0)
    # a file without the order afterwards puts the plain MLP back
    _plain_again(tiny.model, state, images, plain)
    assert tiny.model.model.multi_modal_projector is not plain_module


def test_bad_orders_are_one_line(tiny, monkeypatch):
    monkeypatch.setattr(S, "NUM_IMAGE_TOKENS", PATCHES)
    state = _state(tiny.model, 6)
    cases = {
        "token_order is (15,)": torch.arange(15),
        "not a permutation of the 16": torch.zeros(PATCHES, dtype=torch.int64),
        "1-d integer tensor": torch.arange(PATCHES).float(),
    }
    for message, order in cases.items():
        with pytest.raises(ValueError) as err:
            S.apply_projector(tiny.model, state | {ORDER_KEY: order})
        assert "\n" not in str(err.value) and message in str(err.value)
    assert type(tiny.model.model.multi_modal_projector) is LlavaMultiModalProjector  # left as it was
    both = state | {ORDER_KEY: column_major(PATCHES), POSITION_KEY: torch.zeros(PATCHES, 64)}
    with pytest.raises(ValueError, match="not several"):
        S.apply_projector(tiny.model, both)


def test_a_file_holding_the_order_passes_the_checksum_and_key_checks(tmp_path):
    from safetensors.torch import load_file, save_file

    state = {k: torch.zeros(s) for k, s in [("linear_1.weight", (4, 2)), ("linear_1.bias", (4,))]}
    state |= {"linear_2.weight": torch.zeros(4, 4), "linear_2.bias": torch.zeros(4)}
    path = tmp_path / "ordered.safetensors"
    save_file(state | {ORDER_KEY: column_major(256)}, path)
    loaded = S.load_projector(path, sha256=S._sha256(path))
    assert set(loaded) == S.PROJECTOR_KEYS | {ORDER_KEY}
    assert loaded[ORDER_KEY].dtype == torch.int64 and torch.equal(
        load_file(path)[ORDER_KEY], column_major(256)
    )


def test_install_keeps_the_callers_random_state(tiny):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    install(tiny.model, _state(tiny.model, 7) | {ORDER_KEY: column_major(PATCHES)})
    assert torch.equal(torch.rand(3), expected)


def test_the_onnx_vision_export_carries_the_order(tiny, tmp_path):
    state = _state(tiny.model, 9)
    install(tiny.model, state | {ORDER_KEY: column_major(PATCHES)})
    got, images = _onnx_vision_tokens(tiny.model, tmp_path)
    ordered = _features(tiny.model, images)
    np.testing.assert_allclose(got, ordered.numpy(), rtol=1e-5, atol=1e-5)
    install(tiny.model, state)
    assert np.abs(got - _features(tiny.model, images).numpy()).max() > 1e-2  # the graph does reorder
