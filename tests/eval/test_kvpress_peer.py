"""kvpress side-by-side adapter.

The end-to-end tests need the optional peer venv (`python scripts/kvpress_env.py`, ~1 GB, not
part of CI): kvpress pins transformers<5.3 and cannot live in vlkv's environment. They skip
with that reason when the venv is absent; the job validation tests always run.
"""

import importlib.util
import inspect
import math

import pytest
import torch

from vlkv.eval import kvpress_peer
from vlkv.eval.kvpress_peer import ADAPTER, KVPRESS_NAMES, KvpressJob, KvpressUnavailable, run_kvpress

N_PROMPT = 40


def test_job_validation():
    KvpressJob(model_dir="m", input_ids=[1, 2])
    with pytest.raises(ValueError, match="press must be"):
        KvpressJob(model_dir="m", input_ids=[1], press="h2o_typo")
    with pytest.raises(ValueError, match="budget"):
        KvpressJob(model_dir="m", input_ids=[1], budget=0.0)
    with pytest.raises(ValueError, match="exactly one"):
        KvpressJob(model_dir="m")
    with pytest.raises(ValueError, match="exactly one"):
        KvpressJob(model_dir="m", input_ids=[1], inputs_embeds_path="e.pt")
    with pytest.raises(ValueError, match="continuation_ids"):
        KvpressJob(model_dir="m", input_ids=[1], mode="logits")
    assert "logits_path" not in KvpressJob(model_dir="m", input_ids=[1]).to_json()
    with pytest.raises(ValueError, match="clock"):
        KvpressJob(model_dir="m", input_ids=[1], mode="timing", clock="gpu")


def test_venv_lookup_and_missing_venv_error(monkeypatch, tmp_path):
    monkeypatch.setattr(kvpress_peer, "REPO_ROOT", tmp_path)
    monkeypatch.delenv("VLKV_KVPRESS_VENV", raising=False)
    assert kvpress_peer.kvpress_python() is None
    with pytest.raises(KvpressUnavailable, match="python scripts/kvpress_env.py"):
        run_kvpress([KvpressJob(model_dir="m", input_ids=[1])])
    # A venv counts only once kvpress_env.py has stamped it (after `import kvpress` worked).
    venv = tmp_path / ".venvs" / "kvpress"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    assert kvpress_peer.kvpress_python() is None
    (venv / kvpress_peer.STAMP_NAME).write_text("{}")
    assert kvpress_peer.kvpress_python() == venv / "bin" / "python"
    monkeypatch.setenv("VLKV_KVPRESS_VENV", str(tmp_path / "nowhere"))
    assert kvpress_peer.kvpress_python() == venv / "bin" / "python"


@pytest.fixture(scope="module")
def adapter():
    spec = importlib.util.spec_from_file_location("kvpress_adapter", ADAPTER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # importable without kvpress: presses resolve lazily
    return module


def test_adapter_press_table_matches_vlkv_names(adapter):
    assert tuple(adapter.PRESSES) == KVPRESS_NAMES


@pytest.mark.parametrize("n", [1, 9, 40, 81, 729])
@pytest.mark.parametrize("budget", [0.1, 0.2, 0.25, 0.3, 0.5, 0.7, 0.9, 1.0])
def test_press_ratio_makes_kvpress_keep_vlkv_count(adapter, n, budget):
    # kvpress keeps max(1, int(n * (1 - ratio))) (kvpress.utils.compute_n_kept in 0.5.5).
    def kvpress_kept(ratio):
        return max(1, int(n * (1 - ratio)))

    vlkv_kept = min(max(int(torch.round(torch.tensor(n * budget, dtype=torch.float64))), 1), n)
    assert kvpress_kept(adapter.press_ratio(budget, n, "vlkv")) == vlkv_kept
    assert adapter.press_ratio(budget, n, "kvpress") == 1.0 - budget


def test_press_ratio_kvpress_mode_keeps_the_float_floor(adapter):
    # The trap the "vlkv" mode avoids: 40 * (1 - (1 - 0.1)) = 3.9999999999999996 -> 3 kept.
    assert int(40 * (1 - adapter.press_ratio(0.1, 40, "kvpress"))) == 3
    with pytest.raises(ValueError, match="keep_rounding"):
        adapter.press_ratio(0.5, 40, "ceil")


def test_adapter_kl_against_reference_equals_vlkv_metrics(adapter, tmp_path):
    """The adapter scores kvpress's logits against vlkv's stored full-cache logits with the same
    KL and top-1 definitions as vlkv's own side."""
    from vlkv.eval.metrics import kl_divergence

    g = torch.Generator().manual_seed(3)
    ref, mine = torch.randn(6, 50, generator=g), torch.randn(6, 50, generator=g)
    mine[0] = ref[0]  # one row identical: KL 0, argmax equal
    torch.save(ref, tmp_path / "ref.pt")
    got = adapter._against_reference(mine, str(tmp_path / "ref.pt"))
    torch.testing.assert_close(
        torch.tensor(got["continuation_kl"], dtype=torch.float64),
        kl_divergence(ref, mine),
        rtol=1e-9,
        atol=1e-12,
    )
    assert got["continuation_kl"][0] == 0 and got["continuation_top1"][0] is True
    assert got["continuation_top1"] == (ref.argmax(-1) == mine.argmax(-1)).tolist()
    with pytest.raises(ValueError, match="do not match"):
        adapter._against_reference(mine[:, :10], str(tmp_path / "ref.pt"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg).eval()
    root = tmp_path_factory.mktemp("kvpress")
    model.save_pretrained(root / "model")
    ids = torch.randint(0, 128, (N_PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    cont = torch.randint(0, 128, (6,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        embeds = model.get_input_embeddings()(torch.tensor([ids]))[0]
    torch.save(embeds, root / "embeds.pt")
    return dict(model=model, root=root, ids=ids, cont=cont)


@pytest.fixture(scope="module")
def results(tiny):
    r, ids, cont, md = tiny["root"], tiny["ids"], tiny["cont"], str(tiny["root"] / "model")
    jobs = [
        KvpressJob(md, "none", input_ids=ids, max_new_tokens=5, id="full_greedy"),
        KvpressJob(
            md,
            "none",
            mode="logits",
            input_ids=ids,
            continuation_ids=cont,
            logits_path=str(r / "full.pt"),
            id="full_logits",
        ),
        KvpressJob(
            md,
            "knorm",
            0.5,
            "logits",
            input_ids=ids,
            continuation_ids=cont,
            logits_path=str(r / "knorm.pt"),
            kept_indices_path=str(r / "knorm_kept.pt"),
            id="knorm",
        ),
        KvpressJob(
            md,
            "streaming_llm",
            0.25,
            input_ids=ids,
            max_new_tokens=3,
            kept_indices_path=str(r / "stream_kept.pt"),
            id="stream",
        ),
        KvpressJob(
            md, "snapkv", 0.5, input_ids=ids, press_kwargs={"window_size": 8}, max_new_tokens=4, id="snap_ids"
        ),
        KvpressJob(
            md,
            "snapkv",
            0.5,
            inputs_embeds_path=str(r / "embeds.pt"),
            press_kwargs={"window_size": 8},
            max_new_tokens=4,
            id="snap_embeds",
        ),
        KvpressJob(md, "observed_attention", 0.5, input_ids=ids, max_new_tokens=2, id="observed"),
        KvpressJob(
            md,
            "pyramidkv",
            0.5,
            input_ids=ids,
            press_kwargs={"window_size": 4},
            max_new_tokens=2,
            id="pyramid",
        ),
        KvpressJob(md, "expected_attention", 0.5, input_ids=ids, max_new_tokens=2, id="expected"),
        KvpressJob(
            md, "merging", 0.5, input_ids=ids, press_kwargs={"inner": "knorm"}, max_new_tokens=2, id="merging"
        ),
        KvpressJob(
            md, "knorm", 0.5, "timing", input_ids=ids, max_new_tokens=3, warmup=0, repeats=1, id="timing"
        ),
        KvpressJob(
            md,
            "knorm",
            0.5,
            "timing",
            input_ids=ids,
            max_new_tokens=1,
            repeats=1,
            clock="cpu",
            id="timing_cpu",
        ),
        KvpressJob(md, "knorm", 0.1, input_ids=ids, max_new_tokens=1, id="knorm_vlkv_count"),
        KvpressJob(
            md, "knorm", 0.1, input_ids=ids, max_new_tokens=1, keep_rounding="kvpress", id="knorm_floor"
        ),
        KvpressJob(md, "snapkv", 0.5, input_ids=ids, press_kwargs={"window_size": 64}, id="too_short"),
    ]
    out = run_kvpress(jobs, timeout=600)
    assert [o["id"] for o in out] == [j.id for j in jobs]
    return {o["id"]: o for o in out}


def _ref_cache(model, ids):
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    return out.past_key_values


@pytest.mark.kvpress
def test_full_cache_greedy_matches_transformers_generate(tiny, results):
    res = results["full_greedy"]
    assert res["ok"] and res["versions"]["transformers"].startswith("5.2.")
    ref = tiny["model"].generate(torch.tensor([tiny["ids"]]), max_new_tokens=5, do_sample=False)
    assert res["generated_ids"] == ref[0, N_PROMPT:].tolist()
    assert res["kept_per_layer"] == [N_PROMPT, N_PROMPT]


@pytest.mark.kvpress
def test_full_cache_teacher_forced_logits_match(tiny, results):
    # transformers 5.2 in the venv vs 5.23 here, fp32 on CPU.
    logits = torch.load(results["full_logits"]["logits_path"])
    with torch.no_grad():
        ref = tiny["model"](torch.tensor([tiny["ids"] + tiny["cont"][:-1]])).logits[0, N_PROMPT - 1 :]
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-5)
    assert results["full_logits"]["topk_indices"][0] == ref[0].topk(5).indices.tolist()


@pytest.mark.kvpress
def test_knorm_keeps_smallest_key_norms_and_decodes_at_original_positions(tiny, results):
    from transformers import DynamicCache

    res = results["knorm"]
    assert res["kept_per_layer"] == [20, 20] and math.isclose(res["compression_ratio"], 0.5)
    kept = torch.load(res["kept_indices_path"])
    cache = _ref_cache(tiny["model"], tiny["ids"])
    pairs = []
    for layer, idx in zip(cache.layers, kept):
        ref_idx = layer.keys[0].norm(dim=-1).argsort(dim=-1)[:, :20].sort(dim=-1).values
        assert torch.equal(idx, ref_idx)
        gather = idx[None, :, :, None].expand(-1, -1, -1, layer.keys.shape[-1])
        pairs.append((layer.keys.gather(2, gather), layer.values.gather(2, gather)))
    # Reference: the same compressed cache built here, continuation fed at positions n, n+1, ...
    small = DynamicCache(ddp_cache_data=pairs, config=tiny["model"].config)
    cont = tiny["cont"]
    # transformers renamed the model's cache argument (past_key_values -> cache, 5.2x)
    params = inspect.signature(type(tiny["model"]).forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    with torch.no_grad():
        out = tiny["model"](
            torch.tensor([cont[:-1]]),
            position_ids=torch.arange(N_PROMPT, N_PROMPT + len(cont) - 1)[None],
            **{cache_arg: small},
        )
    logits = torch.load(res["logits_path"])
    torch.testing.assert_close(logits[1:], out.logits[0], rtol=1e-4, atol=1e-5)
    # Compression must change something, or the comparison above proves nothing.
    full = torch.load(results["full_logits"]["logits_path"])
    assert (logits - full).abs().max() > 1e-3


@pytest.mark.kvpress
def test_streaming_llm_keeps_sinks_and_recent(results):
    kept = torch.load(results["stream"]["kept_indices_path"])
    expected = torch.tensor([0, 1, 2, 3, *range(N_PROMPT - 6, N_PROMPT)])
    for idx in kept:
        assert idx.shape == (2, 10)
        assert torch.equal(idx, expected.expand(2, -1))


@pytest.mark.kvpress
def test_inputs_embeds_path_equals_input_ids_path(results):
    a, b = results["snap_ids"], results["snap_embeds"]
    assert a["generated_ids"] == b["generated_ids"]
    torch.testing.assert_close(
        torch.tensor(a["topk_values"]), torch.tensor(b["topk_values"]), rtol=1e-5, atol=1e-6
    )
    assert a["kept_per_layer"] == b["kept_per_layer"] == [20, 20]


@pytest.mark.kvpress
def test_other_presses_run_with_expected_budgets(results):
    assert results["observed"]["attn_implementation"] == "eager"
    for name in ("observed", "expected", "merging"):
        assert results[name]["ok"] and results[name]["kept_per_layer"] == [20, 20], name
    pyramid = results["pyramid"]["kept_per_layer"]
    # Pyramid shape; kvpress's own allocation rounds per layer, so the total is within 1 per layer.
    assert pyramid[0] > pyramid[1] and abs(sum(pyramid) - N_PROMPT) <= len(pyramid)


@pytest.mark.kvpress
def test_keep_rounding_modes(results):
    assert results["knorm_vlkv_count"]["kept_per_layer"] == [4, 4]  # round(40 * 0.1)
    assert results["knorm_floor"]["kept_per_layer"] == [3, 3]  # kvpress's own float floor


@pytest.mark.kvpress
def test_timing_mode_and_error_isolation(results):
    t = results["timing"]
    assert t["prefill_s"] > 0 and t["decode_s"] > 0 and t["decode_tokens"] == 2
    assert t["kept_per_layer"] == [20, 20] and t["clock"] == "wall"
    cpu = results["timing_cpu"]  # the adapter process's CPU time
    assert cpu["clock"] == "cpu" and cpu["prefill_s"] > 0 and cpu["decode_tokens"] == 0
    bad = results["too_short"]
    assert not bad["ok"] and "window size" in bad["error"] and "\n" not in bad["error"]
