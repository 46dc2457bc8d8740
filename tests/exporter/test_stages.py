from __future__ import annotations

import dataclasses
import json

import pytest

from vlkv.exporter import stages
from vlkv.exporter.errors import StageError, StageSkipped
from vlkv.exporter.manifest import read_manifest
from vlkv.exporter.recipe import STAGE_NAMES
from vlkv.exporter.recipe_loader import load_recipe
from vlkv.exporter.stages import STAGES, run_stages


def test_registry_is_ordered_and_complete():
    assert (
        tuple(STAGES)
        == STAGE_NAMES
        == (
            "vision_onnx",
            "decoder_onnx",
            "plugin_graph",
            "trt_engine",
            "trtllm_checkpoint",
            "trtllm_engine",
        )
    )
    for stage in STAGES.values():
        for up in stage.upstream + stage.optional:
            assert STAGE_NAMES.index(up) < STAGE_NAMES.index(stage.name)


@pytest.fixture
def fake_stages(monkeypatch):
    """Replace every stage function by a fast fake that writes one file; records the calls."""
    calls: list[str] = []
    behaviour: dict[str, Exception] = {}

    def make(name):
        def run(recipe, src_dir, out_dir):
            calls.append(name)
            if name in behaviour:
                raise behaviour[name]
            (out_dir / f"{name}.out").write_text(f"{name}:{recipe.policy.budget}")
            (out_dir / "metrics.json").write_text(json.dumps({"max_abs_err": 0.5}))
            return out_dir

        return run

    for name, stage in STAGES.items():
        monkeypatch.setitem(STAGES, name, dataclasses.replace(stage, run=make(name)))
    return calls, behaviour


def test_rerun_skips_and_file_change_rebuilds(fake_stages, tmp_path):
    calls, _ = fake_stages
    recipe = load_recipe()
    first = run_stages(recipe, tmp_path, progress=False)
    assert first.ran == list(STAGE_NAMES) and calls == list(STAGE_NAMES)
    manifest = read_manifest(tmp_path / "vision_onnx")
    assert manifest.metrics == {"max_abs_err": 0.5} and "vision_onnx.out" in manifest.files

    calls.clear()
    second = run_stages(recipe, tmp_path, progress=False)
    assert second.skipped == list(STAGE_NAMES) and calls == []

    # A changed output file reruns that stage; a downstream stage whose inputs did not change stays skipped.
    (tmp_path / "decoder_onnx" / "decoder_onnx.out").write_text("tampered")
    third = run_stages(recipe, tmp_path, progress=False)
    assert calls == ["decoder_onnx"]
    assert third.ran == ["decoder_onnx"]
    assert "changed on disk" in next(r.detail for r in third.results if r.name == "decoder_onnx")


def test_config_change_reruns_dependent_stages_only(fake_stages, tmp_path):
    calls, _ = fake_stages
    run_stages(load_recipe(), tmp_path, progress=False)
    calls.clear()
    # policy feeds decoder_onnx, plugin_graph, trt_engine; their outputs change, so trtllm_engine
    # (downstream of trt_engine) reruns too. vision_onnx and trtllm_checkpoint do not depend on policy.
    report = run_stages(load_recipe(None, ["policy.budget=0.5"]), tmp_path, progress=False)
    assert report.ran == ["decoder_onnx", "plugin_graph", "trt_engine", "trtllm_engine"]
    assert report.skipped == ["vision_onnx", "trtllm_checkpoint"]


def test_failures_block_downstream_but_not_independent_stages(fake_stages, tmp_path):
    calls, behaviour = fake_stages
    behaviour["decoder_onnx"] = StageError("decoder says no")
    behaviour["trtllm_engine"] = StageSkipped("TensorRT-LLM is not installed; skipped trtllm_engine")
    report = run_stages(
        load_recipe(
            None, ["stages=[vision_onnx, decoder_onnx, plugin_graph, trtllm_checkpoint, trtllm_engine]"]
        ),
        tmp_path,
        progress=False,
    )
    status = {r.name: (r.status, r.detail) for r in report.results}
    assert status["vision_onnx"][0] == "ran"
    assert status["decoder_onnx"] == ("failed", "decoder says no")
    assert status["plugin_graph"] == ("blocked", "needs decoder_onnx, which is failed")
    assert status["trtllm_checkpoint"][0] == "ran"
    assert status["trtllm_engine"] == ("unavailable", "TensorRT-LLM is not installed; skipped trtllm_engine")
    assert report.failed == ["decoder_onnx", "plugin_graph"] and report.unavailable == ["trtllm_engine"]
    assert read_manifest(tmp_path / "decoder_onnx") is None  # no manifest for a failed stage
    assert "plugin_graph" not in calls


def test_unavailable_upstream_propagates_or_is_dropped(fake_stages, tmp_path):
    calls, behaviour = fake_stages
    behaviour["trt_engine"] = StageSkipped("TensorRT is not installed; skipped trt_engine")
    report = run_stages(load_recipe(), tmp_path, progress=False)
    # trt_engine is optional for trtllm_engine: it still runs (and lays out the LLM side).
    assert report.unavailable == ["trt_engine"] and "trtllm_engine" in report.ran and report.failed == []
    behaviour["vision_onnx"] = StageSkipped("no vision here")
    report = run_stages(
        load_recipe(None, ["stages=[vision_onnx, trt_engine]"]), tmp_path / "b", progress=False
    )
    assert [(r.name, r.status) for r in report.results] == [
        ("vision_onnx", "unavailable"),
        ("trt_engine", "unavailable"),
    ]
    assert report.results[1].detail == "needs vision_onnx, which is unavailable on this machine"


def test_unexpected_exceptions_become_one_line(fake_stages, tmp_path, monkeypatch):
    _, behaviour = fake_stages
    behaviour["vision_onnx"] = RuntimeError("boom\nsecond line")
    monkeypatch.delenv("VLKV_DEBUG", raising=False)
    report = run_stages(load_recipe(None, ["stages=[vision_onnx]"]), tmp_path, progress=False)
    assert report.results[0].status == "failed"
    assert report.results[0].detail == "RuntimeError: boom (set VLKV_DEBUG=1 for the traceback)"


def test_only_needs_upstream_outputs_on_disk(fake_stages, tmp_path):
    calls, _ = fake_stages
    report = run_stages(load_recipe(), tmp_path, only=["trtllm_engine"], progress=False)
    (result,) = report.results
    assert result.status == "failed"
    assert (
        result.detail
        == f"needs the outputs of trtllm_checkpoint in {tmp_path / 'trtllm_checkpoint'}; run that stage first"
    )
    run_stages(load_recipe(), tmp_path, only=["trtllm_checkpoint"], progress=False)
    calls.clear()
    # Optional upstreams (vision_onnx, trt_engine) that were never built here are left out.
    report = run_stages(load_recipe(), tmp_path, only=["trtllm_engine"], progress=False)
    assert report.ran == ["trtllm_engine"] and calls == ["trtllm_engine"]
    # Once an optional upstream exists on disk it becomes an input: a rerun picks it up.
    run_stages(load_recipe(), tmp_path, only=["vision_onnx"], progress=False)
    report = run_stages(load_recipe(), tmp_path, only=["trtllm_engine"], progress=False)
    assert report.ran == ["trtllm_engine"] and "upstream outputs changed" in report.results[0].detail
    assert run_stages(load_recipe(), tmp_path, only=["trtllm_engine"], progress=False).skipped == [
        "trtllm_engine"
    ]


def test_disabled_trtllm_track(fake_stages, tmp_path):
    calls, _ = fake_stages
    report = run_stages(load_recipe(None, ["trtllm.enabled=false"]), tmp_path, progress=False)
    assert report.names("disabled") == ["trtllm_checkpoint", "trtllm_engine"]
    assert "trtllm_checkpoint" not in calls


def test_unknown_only_stage():
    with pytest.raises(ValueError, match="--stage bogus: unknown stage"):
        run_stages(load_recipe(), "unused", only=["bogus"], progress=False)


def test_missing_hook_module_fails_in_one_line():
    with pytest.raises(StageError) as info:
        stages._hook("vlkv.exporter.not_written_yet", "export", "decoder_onnx")
    assert (
        str(info.value)
        == "vlkv.exporter.not_written_yet is not available yet, so stage decoder_onnx cannot run"
    )
    with pytest.raises(StageError, match=r"vlkv.exporter.recipe.export\(\) is not available yet"):
        stages._hook("vlkv.exporter.recipe", "export", "decoder_onnx")
