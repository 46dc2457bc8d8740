"""A training checkpoint's projector as the safetensors file ``smollm2-llava`` ships and loads.

``scripts/train_projector.py --export`` writes it; the file holds the projector's tensors (the
token order, an integer permutation, kept as it is; floating tensors in the export dtype), any LM
adapters folded into their shipped form (:func:`vlkv.runtime.models.lm_lora.fold`), any trained
vision blocks (:mod:`vlkv.eval.vision_tune`, ``vision_tower.*``), and the run's
step and settings as metadata, with no machine paths.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from vlkv.runtime.models import lm_lora


def export(ckpt_path: Path, dest: Path, dtype: torch.dtype = torch.float32) -> str:
    """Write the projector of the checkpoint at ``ckpt_path`` as safetensors at ``dest``; returns its sha256."""
    from safetensors.torch import save_file

    ckpt = torch.load(ckpt_path, weights_only=False)
    tensors = {
        k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in ckpt["projector"].items()
    }
    if "lm_lora" in ckpt:  # the adapters in the shipped form, the scale folded in
        cfg = ckpt["config"]
        folded = lm_lora.fold(ckpt["lm_lora"], cfg["lm_lora_alpha"] / cfg["lm_lora_rank"])
        tensors |= {k: v.to(dtype) for k, v in folded.items()}
    # trained vision blocks (vlkv.eval.vision_tune), under their vision_tower.* names
    tensors |= {k: v.to(dtype).contiguous() for k, v in ckpt.get("vision", {}).items()}
    dest.parent.mkdir(parents=True, exist_ok=True)
    config = dict(ckpt["config"])
    if config.get("init_from"):  # the run directory's name only: no machine paths in a shipped file
        source = Path(config["init_from"])
        config["init_from"] = "/".join(part for part in (source.parent.name, source.name) if part)
    save_file(tensors, dest, metadata={"step": str(ckpt["step"]), "config": json.dumps(config)})
    return hashlib.sha256(dest.read_bytes()).hexdigest()


def load_init(path: str) -> dict:
    """``--init-from``'s source: a training checkpoint (``.pt``), or a shipped projector file
    (``.safetensors``, as ``--export`` writes it) read as a checkpoint holding only ``projector``.

    A file with LM adapters is refused: they are stored folded, not in the form a run trains.
    """
    if not path.endswith(".safetensors"):
        return torch.load(path, weights_only=False)
    from safetensors.torch import load_file

    tensors = load_file(path)
    if any(k.startswith(lm_lora.PREFIX) for k in tensors):
        raise ValueError(f"init_from {path} holds folded LM adapters; start from its .pt checkpoint")
    return {"projector": tensors}
