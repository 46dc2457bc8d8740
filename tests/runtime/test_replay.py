"""The replay step (KVzip / KVgrad scoring) against an eager reference; it never writes to the cache."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.replay import ReplayRequest, replay_chunks

# float32 tiny models; the eager reference recomputes the context K/V in a fresh forward
ATOL, RTOL = 2e-5, 1e-4


def _prefilled(engine, prompts):
    batch = engine.encode(prompts)
    cache = engine.new_cache(batch)
    engine.prefill(batch, make_policy("full"), cache)
    return batch, cache


def _template_ids(engine, text=ReplayRequest.template):
    return torch.tensor(engine.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def _replay(engine, batch, cache, **kw):
    be = engine.backend
    return be.replay(ReplayRequest(**kw), cache, be.embed(batch), batch.lengths, _template_ids(engine))


def _checksum(cache) -> str:
    """Every layer's K/V (valid and spare columns), slot table and metadata, plus the cache's counters."""
    h = hashlib.sha256()
    for layer in cache.layers:
        k, v = layer.attention_kv(layer.capacity)
        tensors = [k, v, layer.slots, layer.lengths, layer.positions, layer.modality, layer.order]
        for t in [*tensors, layer.next_order, *layer.scores.values()]:
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
    for t in (cache.processed, cache.next_position, cache.prompt_lengths):
        h.update(t.cpu().numpy().tobytes())
    return h.hexdigest()


def _eager_reference(engine, context, template_ids, chunk_size, gradient=False, value_norm=False):
    """One sample's scores from fresh HF forwards over ``[context ; template + chunk]`` with eager
    attention (the full ``T × T`` matrices materialised); ``context (1, n, hidden)``.

    KVgrad: ``d Phi / d (attention output)`` by autograd through the whole HF model, ``Phi`` on the
    replay rows' last decoder-layer output; values from the ``v_proj`` outputs of the context rows.
    ``value_norm``: the ``||W_O v||`` factor alone (no gradient).
    """
    ad = engine.backend.adapter
    lm, n = ad.lm, context.shape[1]
    hkv, heads, d = engine.backend.num_kv_heads, engine.backend.num_heads, engine.backend.head_dim
    template = ad.embed_tokens(template_ids[None])
    best = None
    saved = lm.config._attn_implementation
    lm.config._attn_implementation = "eager"
    attn_out, values, last = {}, {}, {}
    hooks = [
        ad.layers[-1].register_forward_hook(
            lambda m, a, o: last.__setitem__(0, o[0] if isinstance(o, tuple) else o)
        )
    ]
    for i, layer in enumerate(ad.layers):
        hooks.append(
            layer.self_attn.register_forward_hook(lambda m, a, o, i=i: attn_out.__setitem__(i, o[0]))
        )
        hooks.append(
            layer.self_attn.v_proj.register_forward_hook(lambda m, a, o, i=i: values.__setitem__(i, o))
        )
    try:
        for start in range(0, n, chunk_size):
            rows = torch.cat([template, context[:, start : start + chunk_size]], dim=1)
            x = torch.cat([context, rows], dim=1).detach()
            pos = torch.arange(x.shape[1])[None]
            with torch.enable_grad():
                out = lm(inputs_embeds=x, position_ids=pos, output_attentions=True, use_cache=False)
                if gradient:
                    phi = last[0][:, n:].float().square().sum()
                    grads = torch.autograd.grad(phi, [attn_out[i] for i in range(len(ad.layers))])
            scores = []
            for i, a in enumerate(out.attentions):
                att = a[0, :, n:, :n].detach().float()  # (H, r, n)
                if gradient or value_norm:
                    gnorm = grads[i][0, n:].float().norm(dim=-1) if gradient else torch.ones(att.shape[1])
                    v = values[i][0, :n].detach().float().view(n, hkv, d)
                    w = ad.layers[i].self_attn.o_proj.weight.detach().float().view(-1, heads, d)
                    col = torch.stack(
                        [(v[:, h // (heads // hkv)] @ w[:, h].T).norm(dim=-1) for h in range(heads)]
                    )  # (H, n)
                    att = att * gnorm[None, :, None] * col[:, None, :]
                scores.append(att.amax(1).view(hkv, heads // hkv, n).amax(1))
            s = torch.stack(scores)
            best = s if best is None else torch.maximum(best, s)
    finally:
        for hk in hooks:
            hk.remove()
        lm.config._attn_implementation = saved
    return best  # (L, H_kv, n)


PROMPTS = ["The cat sat on the mat while the dog slept by the warm fire all night.", "Hi there."]


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 4096])
def test_replay_equals_the_eager_reference(engines, images, chunk_size):
    engine = engines["tiny-llava"]  # GQA: 4 query heads over 2 KV heads
    prompts = (
        [Prompt(PROMPTS[0], [images[0]]), Prompt(PROMPTS[1])] if chunk_size > 1 else [Prompt(PROMPTS[1])]
    )
    batch, cache = _prefilled(engine, prompts)
    got = _replay(engine, batch, cache, chunk_size=chunk_size)
    embeds = engine.backend.embed(batch)
    for b, n in enumerate(batch.lengths.tolist()):
        want = _eager_reference(engine, embeds[b : b + 1, :n], _template_ids(engine), chunk_size)
        for layer, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g[b, :, :n], w, atol=ATOL, rtol=RTOL, msg=f"layer {layer} sample {b}")
            assert not bool(g[b, :, n:].any())  # padding slots score nothing


@pytest.mark.parametrize("chunk_size", [3, 4096])
def test_kvgrad_scores_equal_the_autograd_reference(engines, chunk_size):
    engine = engines["tiny-llava"]
    batch, cache = _prefilled(engine, [Prompt(PROMPTS[0]), Prompt(PROMPTS[1])])
    got = _replay(engine, batch, cache, chunk_size=chunk_size, gradient=True)
    embeds = engine.backend.embed(batch)
    for b, n in enumerate(batch.lengths.tolist()):
        want = _eager_reference(
            engine, embeds[b : b + 1, :n], _template_ids(engine), chunk_size, gradient=True
        )
        for layer, (g, w) in enumerate(zip(got, want)):
            assert float(w.max()) > 0
            torch.testing.assert_close(
                g[b, :, :n], w, atol=1e-4 * float(w.max()), rtol=1e-3, msg=f"layer {layer}"
            )


@pytest.mark.parametrize("keep", ["none", "some", "all"])
def test_kvgrad_scores_do_not_depend_on_which_layers_keep_their_probabilities(engines, monkeypatch, keep):
    """The forward keeps each layer's probabilities for the backward up to a byte bound, then the
    layers above recompute them: every split gives the reference's scores."""
    from vlkv.runtime import replay_grad

    engine = engines["tiny-llava"]
    batch, cache = _prefilled(engine, [Prompt(PROMPTS[0]), Prompt(PROMPTS[1])])
    want = _replay(engine, batch, cache, chunk_size=5, gradient=True, exact=True)
    b, h = batch.lengths.shape[0], engine.backend.num_heads
    per_layer = b * h * (5 + len(_template_ids(engine))) * (int(batch.lengths.max()) + 16) * 4
    bound = {"none": 0, "some": 3 * per_layer // 2, "all": 1 << 40}[keep]
    monkeypatch.setattr(replay_grad, "KEEP_PROBS_BYTES", bound)
    got = _replay(engine, batch, cache, chunk_size=5, gradient=True)
    for layer, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=1e-6 * float(w.max()), rtol=1e-4, msg=f"layer {layer}")


@pytest.mark.parametrize("exact", [False, True])
def test_value_norm_scores_equal_the_eager_reference(engines, exact):
    engine = engines["tiny-llava"]
    batch, cache = _prefilled(engine, [Prompt(PROMPTS[0]), Prompt(PROMPTS[1])])
    got = _replay(engine, batch, cache, chunk_size=6, value_norm=True, exact=exact)
    embeds = engine.backend.embed(batch)
    for b, n in enumerate(batch.lengths.tolist()):
        want = _eager_reference(engine, embeds[b : b + 1, :n], _template_ids(engine), 6, value_norm=True)
        for layer, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(
                g[b, :, :n], w, atol=1e-5 * float(w.max()), rtol=1e-4, msg=f"layer {layer}"
            )


@pytest.mark.parametrize("gradient", [False, True])
def test_replay_leaves_the_cache_bit_identical(engines, images, gradient):
    engine = engines["tiny-qwen2-vl"]  # M-RoPE positions too
    batch, cache = _prefilled(engine, [Prompt(PROMPTS[0], [images[1]]), Prompt(PROMPTS[1])])
    cache.layers[0].ensure_score("probe").uniform_()
    before = _checksum(cache)
    scores = _replay(engine, batch, cache, chunk_size=7, gradient=gradient)
    assert _checksum(cache) == before
    assert all(s is not None and float(s.max()) > 0 for s in scores)


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any operator produces."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("gradient", [False, True])
def test_replay_memory_grows_linearly_with_context(engines, gradient):
    engine = engines["tiny-llava"]
    peaks, lengths = [], []
    for words in (40, 160):
        batch, cache = _prefilled(
            engine, [Prompt(" ".join(["apple", "river", "stone", "cloud"] * (words // 4)))]
        )
        with _LargestTensor() as mode:
            _replay(engine, batch, cache, chunk_size=16, gradient=gradient)
        peaks.append(mode.numel)
        lengths.append(int(batch.lengths[0]))
    ratio = lengths[1] / lengths[0]
    assert ratio > 3
    # linear: the largest tensor grows like the context, not like its square
    assert peaks[1] / peaks[0] < 1.5 * ratio, (peaks, lengths)
    h, n = engine.backend.num_heads, lengths[1]
    assert peaks[1] < h * n * n / 4  # far below one full T × T attention matrix


def test_chunks_cover_the_context_once(engines):
    template = torch.zeros(3, 8)
    context = torch.arange(2 * 11 * 8, dtype=torch.float32).view(2, 11, 8)
    lengths = torch.tensor([11, 4])
    chunks = replay_chunks(template, context, lengths, ReplayRequest(chunk_size=4))
    assert [c[1].tolist() for c in chunks] == [[7, 7], [7, 0], [6, 0]]
    sub = replay_chunks(template, context, lengths, ReplayRequest(chunk_size=4, every=2))
    assert [c[1].tolist() for c in sub] == [[7, 7], [6, 0]]
    torch.testing.assert_close(sub[1][0][0, 3:], context[0, 8:11], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [(dict(chunk_size=0), "chunk_size"), (dict(every=0), "every"), (dict(mode="x"), "mode")],
)
def test_replay_request_rejects_bad_fields(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ReplayRequest(**kwargs)
