"""Stage ``trt_engine``: ONNX graphs → serialized TensorRT engines, then checked against ONNX Runtime.

Inputs: ``vision_onnx/vision.onnx`` and, when the recipe exports a decoder, its graph
(``plugin_graph/decoder.onnx`` when the recipe runs plugin_graph, else ``decoder_onnx/decoder.onnx``). Outputs: ``vision.engine``, ``decoder.engine``,
``profiles.json`` (the min/opt/max shape of every input per profile) and ``metrics.json``.

``tensorrt`` is imported only here and only when the stage runs. Without it the profiles are still
derived and written (so a bad profile fails on any machine), then the stage raises
:class:`StageSkipped` with one line; the CLI maps that to exit code 3.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np

from vlkv.exporter.errors import StageError, StageSkipped
from vlkv.exporter.recipe import Recipe, TrtSection
from vlkv.exporter.trt_profiles import Shape3, engine_profiles, vision_dims


def import_tensorrt():
    """The ``tensorrt`` module, or None when it cannot be imported (not installed, or its libraries missing)."""
    try:
        import tensorrt
    except (ImportError, OSError):
        return None
    return tensorrt


def graphs(recipe: Recipe, src_dir: Path) -> dict[str, tuple[Path, list[tuple[str, dict[str, list[int]]]]]]:
    """``{engine name: (onnx path, named profiles)}`` for every graph this recipe builds."""
    found = {"vision": (src_dir / "vision_onnx" / "vision.onnx", [("vision", vision_dims(recipe))])}
    # The decoder engine is built only when the recipe exports a decoder graph.
    decoder_stage = next((s for s in ("plugin_graph", "decoder_onnx") if s in recipe.stages), None)
    if decoder_stage is not None:
        profiles = [(p.name, p.dims) for p in recipe.decoder.profiles]
        found["decoder"] = (src_dir / decoder_stage / "decoder.onnx", profiles)
    for name, (path, _) in found.items():
        if not path.is_file():
            raise StageError(f"{name} graph {path} is missing; run its stage first")
    return found


def run(recipe: Recipe, src_dir: Path, out_dir: Path) -> Path:
    """Stage entry point (see module doc)."""
    plans = {
        name: (path, engine_profiles(path, profiles))
        for name, (path, profiles) in graphs(recipe, src_dir).items()
    }
    serializable = {
        n: {p: {i: list(map(list, s)) for i, s in shapes.items()} for p, shapes in prof.items()}
        for n, (_, prof) in plans.items()
    }
    (out_dir / "profiles.json").write_text(json.dumps(serializable, indent=2) + "\n")
    trt = import_tensorrt()
    if trt is None:
        raise StageSkipped(f"TensorRT is not installed; skipped trt_engine (ONNX artifacts are in {src_dir})")
    register_plugins(recipe.plugins)
    metrics = {}
    for name, (onnx_path, profiles) in plans.items():
        engine_path = out_dir / f"{name}.engine"
        build_engine(trt, onnx_path, engine_path, list(profiles.values()), recipe.trt)
        first = next(iter(profiles.values()))
        metrics[name] = compare_engine(engine_path, onnx_path, first, recipe.trt)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    failed = [n for n, m in metrics.items() if not m["passed"]]
    if failed:
        raise StageError(
            f"TensorRT engine(s) {', '.join(failed)} differ from ONNX Runtime beyond trt.compare_atol/rtol"
        )
    return out_dir


def register_plugins(names: list[str]) -> None:
    """Register vlkv's TensorRT plugins (``vlkv.plugins.trt_plugins``) when the recipe names any."""
    if not names:
        return
    try:
        # import_module, not `from vlkv.plugins import ...`: the latter can be satisfied by a stale
        # package attribute even when the module itself cannot be imported
        trt_plugins = importlib.import_module("vlkv.plugins.trt_plugins")
    except ImportError as exc:
        raise StageError(
            f"recipe plugins {names} need vlkv.plugins.trt_plugins, which is missing ({exc.name})"
        ) from None
    trt_plugins.register_plugins()


def build_engine(
    trt, onnx_path: Path, engine_path: Path, profiles: list[dict[str, Shape3]], section: TrtSection
) -> None:
    """Parse ``onnx_path`` with ``trt.OnnxParser``, add one optimisation profile per entry, serialize.

    Args:
        trt: the imported ``tensorrt`` module (passed in so the caller decides how it is found).
        profiles: per profile, ``{input name: (min, opt, max) shapes}``.
    """
    logger = trt.Logger(trt.Logger.WARNING)
    trt.init_libnvinfer_plugins(logger, "")
    builder = trt.Builder(logger)
    network = builder.create_network(_network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise StageError(f"TensorRT cannot parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(section.workspace_gb * (1 << 30)))
    config.builder_optimization_level = section.builder_opt_level
    # TensorRT >= 10.12 deprecates weak typing (and 11 drops the FP16 flag): the graph's own dtypes rule there.
    if section.fp16 and hasattr(trt.BuilderFlag, "FP16"):
        config.set_flag(trt.BuilderFlag.FP16)
    for shapes in profiles:
        if all(lo == hi for lo, _, hi in shapes.values()):
            continue  # a fully static graph needs no profile
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise StageError(
            f"TensorRT failed to build an engine from {onnx_path.name} (see the builder log above)"
        )
    engine_path.write_bytes(bytes(serialized))


def _network_flags(trt) -> int:
    # Explicit batch is implicit from TensorRT 10 on; 8.x needs the flag.
    flag = getattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH", None)
    major = int(str(trt.__version__).split(".")[0])
    return 1 << int(flag) if flag is not None and major < 10 else 0


def sample_feeds(shapes: dict[str, Shape3], seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs at each input's opt shape: token ids in [0, 100), masks of ones, positions 0..n-1, floats N(0, 1)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, (_, opt, _) in shapes.items():
        if name == "input_ids":
            feeds[name] = rng.integers(0, 100, size=opt, dtype=np.int64)
        elif name == "attention_mask" and len(opt) == 2:
            feeds[name] = np.ones(opt, dtype=np.int64)
        elif name == "position_ids":
            # Positions continue after the past: attention_mask spans past + new tokens.
            total = shapes["attention_mask"][1][-1] if "attention_mask" in shapes else opt[-1]
            feeds[name] = np.broadcast_to(np.arange(total - opt[-1], total, dtype=np.int64), opt).copy()
        else:
            feeds[name] = rng.standard_normal(size=opt).astype(np.float32)
    return feeds


def compare_engine(
    engine_path: Path, onnx_path: Path, shapes: dict[str, Shape3], section: TrtSection
) -> dict:
    """Polygraphy: ``TrtRunner`` on the engine vs ``OnnxrtRunner`` on the graph, at the first profile's opt shapes."""
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner
    from polygraphy.comparator import Comparator, SimpleCompareFunc
    from polygraphy.logger import G_LOGGER

    feeds = [sample_feeds(shapes)]
    runners = [
        TrtRunner(EngineFromBytes(engine_path.read_bytes())),
        OnnxrtRunner(SessionFromOnnx(str(onnx_path), providers=["CPUExecutionProvider"])),
    ]
    with G_LOGGER.verbosity(G_LOGGER.ERROR), np.errstate(divide="ignore", invalid="ignore"):
        results = Comparator.run(runners, data_loader=feeds)
        passed = bool(
            Comparator.compare_accuracy(
                results, compare_func=SimpleCompareFunc(atol=section.compare_atol, rtol=section.compare_rtol)
            )
        )
    (_, trt_iters), (_, ort_iters) = results
    err = max(
        float(
            np.abs(trt_iters[0][k].astype(np.float64) - ort_iters[0][k].astype(np.float64)).max(initial=0.0)
        )
        for k in ort_iters[0]
    )
    return {"passed": passed, "max_abs_err": err, "atol": section.compare_atol, "rtol": section.compare_rtol}
