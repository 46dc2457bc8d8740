"""Record keys: the same inputs give the same key in every process; any input change gives another."""

from __future__ import annotations

import copy
import hashlib

import pytest
import torch

from tests.runtime.store.helpers import FP, OTHER_FP, SETTINGS
from vlkv.runtime.store import (
    LAYOUT_VERSION,
    SHARED_TENANT,
    Identity,
    image_content,
    model_fingerprint,
    processor_settings,
    record_key,
    validate_tenant,
)

IMAGE = b"\x89PNG fake image bytes"


def _key(**changes) -> str:
    args = dict(
        model_fingerprint=FP, processor_settings=SETTINGS, content=IMAGE, uuid=None,
        layout_version=LAYOUT_VERSION, tenant="alice",
    )  # fmt: skip
    args.update(changes)
    return record_key(**args)


def test_same_inputs_same_key_and_a_pinned_value():
    a = _key()
    assert a == _key(content=bytes(bytearray(IMAGE)), processor_settings=copy.deepcopy(SETTINGS))
    # dict order does not matter: the settings are canonical JSON
    assert a == _key(processor_settings=dict(reversed(list(SETTINGS.items()))))
    assert len(a) == 64 and set(a) <= set("0123456789abcdef")
    # pinned: a key never depends on the process (no hash(), no id()); it changes only with the layout
    assert a == "d2be033bd8e7ccf9847a57a69c0df8c3351b425f29b2dfd4b3b2adccae781656"


def test_every_input_changes_the_key():
    base = _key()
    changed = [
        _key(tenant="bob"),
        _key(tenant=SHARED_TENANT),
        _key(model_fingerprint=OTHER_FP),
        _key(processor_settings={**SETTINGS, "size": {"shortest_edge": 57}}),
        _key(processor_settings={}),
        _key(content=IMAGE + b"\0"),
        _key(content=None, uuid="client-image-1"),
        _key(layout_version=LAYOUT_VERSION + 1),
    ]
    assert len({base, *changed}) == len(changed) + 1


def test_uuid_and_content_never_collide_and_exactly_one_is_needed():
    digest = hashlib.sha256(IMAGE).hexdigest()
    assert _key(content=None, uuid=f"sha256:{digest}") != _key()
    assert _key(content=None, uuid="u1") == _key(content=None, uuid="u1")
    with pytest.raises(ValueError, match="exactly one"):
        _key(uuid="u1")
    with pytest.raises(ValueError, match="exactly one"):
        _key(content=None)
    with pytest.raises(ValueError, match="JSON"):
        _key(processor_settings={"x": float("nan")})
    with pytest.raises(ValueError, match="JSON"):
        _key(processor_settings={"x": object()})


@pytest.mark.parametrize("bad", ["", "a/b", "..", ".", "a\\b", "x" * 65, "tab\t", "é", "_shared", None, 3])
def test_bad_tenant_names_are_one_line_errors_naming_them(bad):
    with pytest.raises(ValueError) as info:
        validate_tenant(bad)
    msg = str(info.value)
    assert "\n" not in msg and repr(bad) in msg
    if isinstance(bad, str) and bad != "_shared":
        with pytest.raises(ValueError, match="tenant"):
            _key(tenant=bad)


def test_good_tenant_names():
    for name in ("alice", "team-1.prod", "A_b", "x" * 64, "...a"):
        assert validate_tenant(name) == name
    assert validate_tenant(SHARED_TENANT, allow_reserved=True) == SHARED_TENANT


def test_image_content_follows_pixels():
    from PIL import Image

    a = Image.new("RGB", (4, 3), (1, 2, 3))
    assert image_content(a) == image_content(a.copy())
    assert image_content(a) != image_content(Image.new("RGB", (3, 4), (1, 2, 3)))
    assert image_content(a) != image_content(Image.new("RGB", (4, 3), (1, 2, 4)))


def test_model_fingerprint_covers_config_and_every_weight(tiny_llava):
    fp = model_fingerprint(tiny_llava)
    assert len(fp) == 64 and model_fingerprint(tiny_llava) == fp  # cached on the object
    # an equal model elsewhere gives the same fingerprint; a copy with one changed weight another
    module = torch.nn.Linear(3, 2)
    assert model_fingerprint(module) == model_fingerprint(copy.deepcopy(module))
    other = copy.deepcopy(module)
    with torch.no_grad():
        other.weight[0, 0] += 1e-3
    assert model_fingerprint(other) != model_fingerprint(module)
    assert model_fingerprint(torch.nn.Linear(3, 2, dtype=torch.float64)) != model_fingerprint(module)
    settings = processor_settings(tiny_llava)
    assert settings["family"] == "llava" and "image_mean" in settings
    assert Identity.of(fp, settings, content=b"x").key("a") == record_key(fp, settings, b"x", tenant="a")
