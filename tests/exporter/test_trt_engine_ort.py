"""The whole trt_engine stage on the demo's real graphs, with ONNX Runtime standing in for TensorRT.

The stand-in "builds" an engine by writing the graph with its plugin nodes in ONNX Runtime form (the
onnxruntime-extensions reference ops of ``vlkv.plugins.onnx_ort``), and its runner refuses what a
TensorRT engine refuses: feeds outside the selected optimisation profile and feeds whose dtype is not
the engine input's. Everything else (graph choice, profiles, feeds, reference graph, threshold, the
Polygraphy comparison, metrics) is the stage's own code.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from vlkv.exporter import trt_engine
from vlkv.exporter.errors import StageError
from vlkv.exporter.recipe_loader import load_recipe
from vlkv.exporter.stages import run_stages

DEMO = "recipes/demo.yaml"


class OnnxRuntimeAsTensorRT:
    """An EngineBackend whose engines are ONNX graphs run by ONNX Runtime (plugins as reference ops)."""

    def __init__(self):
        self.profiles: dict[str, list] = {}
        self.fed: list[dict[str, np.ndarray]] = []

    def build(self, onnx_path, engine_path, profiles, section) -> None:
        import onnx

        from vlkv.plugins.onnx_ops import convert_model

        model = convert_model(onnx.load(str(onnx_path)), "ort")
        engine_path.write_bytes(model.SerializeToString())
        self.profiles[engine_path.name] = profiles

    def runner(self, engine_path, profile_index: int):
        import onnxruntime as ort
        from polygraphy.backend.onnxrt import OnnxrtRunner

        from vlkv.plugins.onnx_ort import ort_session_options

        profile = self.profiles[engine_path.name][profile_index]
        fed = self.fed

        def session():
            options = ort_session_options()
            return ort.InferenceSession(engine_path.read_bytes(), options, providers=["CPUExecutionProvider"])

        class ProfileCheckingRunner(OnnxrtRunner):
            def infer_impl(self, feed_dict):
                types = {i.name: i.type for i in self.sess.get_inputs()}
                for name, value in feed_dict.items():
                    lo, _, hi = profile[name]
                    inside = len(value.shape) == len(lo) and all(
                        a <= d <= b for a, d, b in zip(lo, value.shape, hi)
                    )
                    assert inside, f"{name}: shape {value.shape} outside profile [{lo}, {hi}]"
                    assert types[name] == f"tensor({value.dtype.name.replace('float32', 'float')})", name
                fed.append(dict(feed_dict))
                return super().infer_impl(feed_dict)

        return ProfileCheckingRunner(session, name=f"ort-as-trt:{engine_path.name}")


@pytest.fixture(scope="module")
def demo_build(tmp_path_factory):
    """The demo recipe's ONNX stages, built once: vision, decomposed decoder, plugin-rewritten decoder."""
    root = tmp_path_factory.mktemp("demo")
    overrides = ["stages=[vision_onnx, decoder_onnx, plugin_graph, trt_engine]", "decoder.max_seq=16"]
    recipe = load_recipe(DEMO, overrides)
    report = run_stages(recipe, root, only=["vision_onnx", "decoder_onnx", "plugin_graph"], progress=False)
    assert report.failed == [], report.results
    return recipe, root


def test_decoder_and_vision_engines_are_checked_end_to_end(demo_build, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # nothing below may reach for TensorRT
    recipe, root = demo_build
    out = tmp_path / "trt_engine"
    out.mkdir()
    backend = OnnxRuntimeAsTensorRT()
    # Polygraphy casts feeds to each runner's input dtypes, which would hide float lengths: record
    # the feeds as the stage hands them over.
    handed: list[dict[str, np.ndarray]] = []
    real_compare = trt_engine.compare_engine

    def spy(runner, reference, feeds, section):
        handed.extend(feeds)
        return real_compare(runner, reference, feeds, section)

    monkeypatch.setattr(trt_engine, "compare_engine", spy)
    trt_engine.run(recipe, root, out, backend=backend)

    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics) == {"vision", "decoder"}
    decoder = metrics["decoder"]
    # The TensorRT-form graph was built; ONNX Runtime checked it against the decomposed decoder.
    assert decoder["reference"] == "decoder_onnx/decoder.onnx"
    assert set(decoder["profiles"]) == {"prefill", "decode"}
    assert decoder["passed"] and decoder["max_abs_err"] < 1e-4, decoder
    assert metrics["vision"]["passed"] and metrics["vision"]["max_abs_err"] == 0.0

    baked = json.loads((root / "plugin_graph" / "metrics.json").read_text())["threshold"]
    assert len(backend.fed) == len(handed) == 3  # one feed per profile: vision 1, decoder 2
    decoder_feeds = [f for f in handed if "past_lengths" in f]
    assert len(decoder_feeds) == 2
    for feeds in decoder_feeds:
        for name in ("past_lengths", "new_lengths", "logits_index", "stats_rows", "position_ids"):
            assert feeds[name].dtype == np.int64, name
        assert feeds["inputs_embeds"].dtype == np.float32
        # The reference's runtime threshold is the one the rewrite baked into the plugin.
        assert feeds["stats_threshold"].tolist() == [pytest.approx(baked)]
    decode = next(f for f in decoder_feeds if f["past_key_values.0.key"].shape[2] > 0)
    assert set(decode["past_lengths"][:, 0].tolist()) == {
        8
    }  # every layer at the decode opt past, max_seq // 2


def test_a_mismatching_engine_fails_the_stage(demo_build, tmp_path, monkeypatch):
    recipe, root = demo_build

    class Broken(OnnxRuntimeAsTensorRT):
        def build(self, onnx_path, engine_path, profiles, section):
            import onnx
            from onnx import helper

            super().build(onnx_path, engine_path, profiles, section)
            if engine_path.name == "decoder.engine":  # scale the logits: a wrong engine
                model = onnx.load_from_string(engine_path.read_bytes())
                logits = next(o for o in model.graph.output if o.name == "logits")
                for node in model.graph.node:
                    node.output[:] = ["logits_raw" if o == "logits" else o for o in node.output]
                model.graph.node.append(helper.make_node("Mul", ["logits_raw", "two"], ["logits"]))
                model.graph.initializer.append(helper.make_tensor("two", 1, [], [2.0]))
                assert logits.name == "logits"
                engine_path.write_bytes(model.SerializeToString())

    out = tmp_path / "trt_engine"
    out.mkdir()
    with pytest.raises(StageError, match=r"^TensorRT engine\(s\) decoder differ from ONNX Runtime"):
        trt_engine.run(recipe, root, out, backend=Broken())
    assert not json.loads((out / "metrics.json").read_text())["decoder"]["passed"]


def test_feeds_take_dtypes_from_the_graph_like_the_rewrite_check(demo_build):
    import onnx

    from vlkv.exporter.graph_rewrite import decoder_feeds_for
    from vlkv.exporter.trt_profiles import engine_profiles

    recipe, root = demo_build
    path = root / "decoder_onnx" / "decoder.onnx"
    profiles = engine_profiles(path, [(p.name, p.dims) for p in recipe.decoder.profiles])
    ours = trt_engine.sample_feeds(profiles["decode"], trt_engine.input_dtypes(path))
    theirs = decoder_feeds_for(onnx.load(str(path), load_external_data=False))
    assert {k: v.dtype for k, v in ours.items()} == {k: v.dtype for k, v in theirs.items()}
