"""Kept sets of a policy run, as digests: what a refactor of the policies must leave unchanged.

For each request run alone, every state of its cache that a decode step reads (after the prefill's
edits, then after each decode step's) is reduced, per layer, to the token indices (``order``) each
KV head holds; the digest of those sets is recorded per (state, layer), plus the generated tokens.
"""

from __future__ import annotations

import hashlib
import json

import torch

MODELS = ("tiny-llava", "tiny-qwen2-vl")
NEW = 6

# (name, settings): every policy that became a score, their compositions (allocators, cadence, the
# per-head / model-wide budgets), small windows so that the scores rank something on tiny prompts,
# and the policies that stayed as they were (avl, elastic) as a control
SPECS: list[tuple[str, dict]] = [
    ("h2o", {"budget": 0.5}),
    ("h2o", {"budget": 0.3, "heavy_ratio": 0.8}),
    ("h2o", {"budget": 0.4, "evict_every": 3}),
    ("h2o", {"budget": 0.4, "allocator": "sparsity"}),
    ("h2o", {"budget": 0.4, "allocator": "pyramid", "allocator_beta": 4.0}),
    ("snapkv", {"budget": 0.3}),
    ("snapkv", {"budget": 0.4, "window": 8, "kernel": 3}),
    ("snapkv", {"budget": 0.4, "window": 8, "allocator": "pyramid"}),
    ("pyramidkv", {"budget": 0.4, "window": 8}),
    ("pyramidkv", {"budget": 0.4, "window": 8, "fallback": True}),
    ("vlcache", {"budget": 0.3}),
    ("vlcache", {"budget": 0.4, "heads": "layer", "allocator": "pyramid", "recent_ratio": 0.3}),
    ("local", {"budget": 0.4}),
    ("local", {"budget": 0.5, "allocator": "uniform"}),
    ("local", {"budget": 0.4, "sinks": 2, "evict_every": 2}),
    ("kvzip", {"budget": 0.5}),
    ("kvzip", {"budget": 0.3, "scope": "layer"}),
    ("kvzip", {"budget": 0.4, "heads": "own"}),
    ("kvzip", {"budget": 0.4, "heads": "own", "scope": "layer"}),
    ("kvzip", {"budget": 0.4, "heads": "shared", "value_norm": True}),
    ("kvgrad", {"budget": 0.5}),
    ("avl", {"budget": 0.5, "core": 0.3}),
    ("elastic", {"budget": 0.5}),
]


def spec_id(name: str, kw: dict) -> str:
    return name + "".join(f",{k}={v}" for k, v in sorted(kw.items()))


def prompts(images):
    from vlkv.runtime.prompt import Prompt

    return [
        Prompt("Describe the picture.", [images[0]]),
        Prompt("What differs between these two?", [images[1], images[2]]),
        Prompt("Write a short poem about caches."),
    ]


def _held(layer) -> list[list[list[int]]]:
    """Per sample and KV head, the sorted token indices the layer holds."""
    n = layer.max_length
    valid = layer.valid_mask(n)[:, None, :].expand(-1, layer.kv_heads, -1)
    if layer.holes is not None:
        valid = valid & ~layer.holes[:, :, :n]
    order = layer.order[:, :, :n]
    return [
        [sorted(order[b, h][valid[b, h]].tolist()) for h in range(order.shape[1])]
        for b in range(order.shape[0])
    ]


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj).encode()).hexdigest()[:16]


def kept_digests(engine, name: str, kw: dict, images) -> list[dict]:
    """One record per prompt: ``tokens`` and ``states`` (per state, per layer, a digest)."""
    from vlkv.runtime.policies import make_policy

    out = []
    for prompt in prompts(images):
        policy = make_policy(name, **kw)
        states: list[list[str]] = []
        ask = policy.decode_request

        def record(cache, ctx, ask=ask, states=states):
            states.append([_digest(_held(layer)) for layer in cache.layers])
            return ask(cache, ctx)

        policy.decode_request = record  # the instance's hook: every decode step reads it first
        with torch.no_grad():
            res = engine.generate([prompt], policy, NEW, stop_at_eos=False)
        out.append({"tokens": res.samples[0].token_ids, "states": states})
    return out
