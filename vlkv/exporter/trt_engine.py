"""Stage ``trt_engine``: ONNX graphs → serialized TensorRT engines, then checked against ONNX Runtime.

Inputs: ``vision_onnx/vision.onnx`` and, when the recipe exports a decoder, its graph
(``plugin_graph/decoder.onnx`` when the recipe runs plugin_graph, else ``decoder_onnx/decoder.onnx``).
Outputs: ``vision.engine``, ``decoder.engine``, ``profiles.json`` (the min/opt/max shape of every input
per profile) and ``metrics.json``.

Each engine is compared, at the opt shapes of every profile, with ONNX Runtime on an ORT-runnable
reference graph: the same ONNX for the vision tower, and for a plugin-rewritten decoder the
decomposed ``decoder_onnx/decoder.onnx`` (ONNX Runtime cannot run the TensorRT-form plugin nodes) with
``stats_threshold`` set to the threshold the rewrite baked into the plugin. Feeds take every input's
dtype from the graph and follow the decoder's I/O contract (``vlkv.exporter.decoder_graph``): valid
int64 lengths, positions and row indices, not random floats.

Building and running engines goes through an :class:`EngineBackend`; the default one is TensorRT
(``tensorrt`` is imported only here and only when the stage runs). Without it the profiles are still
derived and written (so a bad profile fails on any machine), then the stage raises
:class:`StageSkipped` with one line; the CLI maps that to exit code 3. Tests pass a backend that
stands ONNX Runtime in for TensorRT, so everything but the TensorRT calls runs on CPU.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from vlkv.exporter.errors import StageError, StageSkipped
from vlkv.exporter.recipe import Recipe, TrtSection
from vlkv.exporter.trt_profiles import Shape3, engine_profiles, vision_dims

# ONNX TensorProto element types of graph inputs → numpy dtypes for the feeds.
_NUMPY_DTYPES = {1: np.float32, 10: np.float16, 11: np.float64, 6: np.int32, 7: np.int64, 9: np.bool_}


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


class EngineBackend(Protocol):
    """What the stage needs from an engine toolkit: build an engine file, and a Polygraphy runner for it."""

    def build(
        self, onnx_path: Path, engine_path: Path, profiles: list[dict[str, Shape3]], section: TrtSection
    ) -> None: ...

    def runner(self, engine_path: Path, profile_index: int):
        """A Polygraphy runner executing ``engine_path`` with optimisation profile ``profile_index``."""


class TensorRTBackend:
    """The real thing: ``trt.Builder`` via :func:`build_engine`, Polygraphy's ``TrtRunner``."""

    def __init__(self, trt):
        self.trt = trt

    def build(self, onnx_path, engine_path, profiles, section) -> None:
        build_engine(self.trt, onnx_path, engine_path, profiles, section)

    def runner(self, engine_path: Path, profile_index: int):
        from polygraphy.backend.trt import EngineFromBytes, TrtRunner

        return TrtRunner(EngineFromBytes(engine_path.read_bytes()), optimization_profile=profile_index)


def run(recipe: Recipe, src_dir: Path, out_dir: Path, backend: EngineBackend | None = None) -> Path:
    """Stage entry point (see module doc); ``backend`` defaults to TensorRT."""
    plans = {
        name: (path, engine_profiles(path, profiles))
        for name, (path, profiles) in graphs(recipe, src_dir).items()
    }
    serializable = {
        n: {p: {i: list(map(list, s)) for i, s in shapes.items()} for p, shapes in prof.items()}
        for n, (_, prof) in plans.items()
    }
    (out_dir / "profiles.json").write_text(json.dumps(serializable, indent=2) + "\n")
    if backend is None:
        trt = import_tensorrt()
        if trt is None:
            raise StageSkipped(
                f"TensorRT is not installed; skipped trt_engine (ONNX artifacts are in {src_dir})"
            )
        register_plugins(recipe.plugins, recipe.trt.ptx_arch)
        backend = TensorRTBackend(trt)
    metrics = {}
    for name, (onnx_path, profiles) in plans.items():
        engine_path = out_dir / f"{name}.engine"
        backend.build(onnx_path, engine_path, list(profiles.values()), recipe.trt)
        reference, fixed = reference_graph(recipe, src_dir, name, onnx_path)
        metrics[name] = compare_profiles(backend, engine_path, reference, profiles, recipe.trt, fixed)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    failed = [n for n, m in metrics.items() if not m["passed"]]
    if failed:
        raise StageError(
            f"TensorRT engine(s) {', '.join(failed)} differ from ONNX Runtime beyond trt.compare_atol/rtol"
        )
    return out_dir


def reference_graph(
    recipe: Recipe, src_dir: Path, name: str, onnx_path: Path
) -> tuple[Path, dict[str, np.ndarray]]:
    """The ORT-runnable graph an engine is checked against, and inputs fixed for the check.

    A plugin-rewritten decoder is checked against the decomposed decoder it came from, with the
    threshold the rewrite baked into ``AttnStats`` fed as ``stats_threshold``.
    """
    if name != "decoder" or onnx_path.parent.name != "plugin_graph":
        return onnx_path, {}
    decomposed = src_dir / "decoder_onnx" / onnx_path.name
    if not decomposed.is_file():
        raise StageError(
            f"{decomposed} is missing: the plugin decoder is checked against it; run decoder_onnx"
        )
    threshold = np.array([plugin_threshold(recipe, onnx_path.parent)], dtype=np.float32)
    return decomposed, {"stats_threshold": threshold}


def plugin_threshold(recipe: Recipe, plugin_dir: Path) -> float:
    """The ``AttnStats`` threshold of the rewritten graph: as plugin_graph recorded it, else the policy's."""
    metrics = plugin_dir / "metrics.json"
    if metrics.is_file():
        recorded = json.loads(metrics.read_text()).get("threshold")
        if recorded is not None:
            return float(recorded)
    from vlkv.exporter.graph_rewrite import policy_threshold

    return policy_threshold(recipe.policy.name, recipe.policy.options)


def register_plugins(names: list[str], arch: str | None = None) -> None:
    """Register vlkv's TensorRT plugins (``vlkv.plugins.trt_plugins``) when the recipe names any.

    arch: ``trt.ptx_arch`` (None = the build machine's GPU), the target of the plugins' PTX.
    """
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
    try:
        trt_plugins.register_plugins(arch=arch)
    except ValueError as exc:  # an unsupported or undeterminable architecture: already one line
        raise StageError(str(exc)) from None


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
    # A fully static graph needs no profile. Otherwise every profile is added, static ones included, so
    # that profile i of the engine is entry i of ``profiles`` (the comparison selects them by index).
    static = all(lo == hi for shapes in profiles for lo, _, hi in shapes.values())
    for shapes in [] if static else profiles:
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


def input_dtypes(onnx_path: str | Path) -> dict[str, np.dtype]:
    """numpy dtype of every graph input (initializers excluded), from the graph's own input types."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    initializers = {i.name for i in model.graph.initializer}
    found = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        elem = value.type.tensor_type.elem_type
        if elem not in _NUMPY_DTYPES:
            raise StageError(
                f"{Path(onnx_path).name}: input {value.name} has element type {elem}, which cannot be fed"
            )
        found[value.name] = np.dtype(_NUMPY_DTYPES[elem])
    return found


def sample_feeds(
    shapes: dict[str, Shape3], dtypes: dict[str, np.dtype] | None = None, seed: int = 0
) -> dict[str, np.ndarray]:
    """Seeded, valid inputs at each input's opt shape, in the graph's dtypes (float32 where not given).

    optimum-style graphs: token ids in [0, 100), masks of ones, positions after the past. vlkv
    decoder graphs (``past_lengths`` among the inputs, contract in ``vlkv.exporter.decoder_graph``):
    sample ``b`` has ``P_l - b`` valid past entries in layer ``l`` and ``q - b`` valid new rows (at least
    1, so padding is exercised), positions continue after its longest past, ``logits_index`` picks its
    last valid rows, every row enters the statistics, ``stats_threshold`` is 0.05. Other inputs: N(0, 1).
    """
    rng = np.random.default_rng(seed)
    dtypes = dtypes or {}
    opt = {name: tuple(s[1]) for name, s in shapes.items()}
    feeds = _decoder_feeds(opt) if "past_lengths" in opt else {}
    for name, size in opt.items():
        if name in feeds:
            continue
        if name == "input_ids":
            feeds[name] = rng.integers(0, 100, size=size, dtype=np.int64)
        elif name == "attention_mask" and len(size) == 2:
            feeds[name] = np.ones(size, dtype=np.int64)
        elif name == "position_ids":
            # Positions continue after the past: attention_mask spans past + new tokens.
            total = opt["attention_mask"][-1] if "attention_mask" in opt else size[-1]
            feeds[name] = np.broadcast_to(np.arange(total - size[-1], total, dtype=np.int64), size).copy()
        else:
            feeds[name] = rng.standard_normal(size=size)
    return {name: value.astype(dtypes.get(name, value.dtype if value.dtype != np.float64 else np.float32))
            for name, value in feeds.items()}  # fmt: skip


def _decoder_feeds(opt: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """The integer inputs of a vlkv decoder graph at the given shapes (see :func:`sample_feeds`)."""
    layers, batch = opt["past_lengths"]
    rows = opt["position_ids"][-1]
    b = np.arange(batch)
    past = np.array([opt[f"past_key_values.{i}.key"][2] for i in range(layers)])
    past_lengths = np.maximum(past[:, None] - b[None, :], 0)
    new_lengths = np.maximum(rows - b, 1)
    positions = past_lengths.max(axis=0)[:, None] + np.arange(rows)[None, :]
    kept = opt["logits_index"][1]
    logits_index = np.clip(new_lengths[:, None] - kept + np.arange(kept)[None, :], 0, rows - 1)
    return {
        "past_lengths": past_lengths,
        "new_lengths": new_lengths,
        "position_ids": np.broadcast_to(positions, opt["position_ids"]).copy(),
        "logits_index": logits_index,
        "stats_rows": np.ones(opt["stats_rows"], dtype=np.int64),
        "stats_threshold": np.full(opt["stats_threshold"], 0.05),
    }


def compare_profiles(
    backend: EngineBackend,
    engine_path: Path,
    reference: Path,
    profiles: dict[str, dict[str, Shape3]],
    section: TrtSection,
    fixed: dict[str, np.ndarray] | None = None,
) -> dict:
    """The engine against ONNX Runtime on ``reference`` at the opt shapes of every profile.

    ``fixed`` overrides feeds by name (the decoder's baked-in ``stats_threshold``).
    """
    dtypes = input_dtypes(reference)
    per_profile = {}
    for index, (label, shapes) in enumerate(profiles.items()):
        feeds = sample_feeds(shapes, dtypes) | (fixed or {})
        per_profile[label] = compare_engine(backend.runner(engine_path, index), reference, [feeds], section)
    return {
        "passed": all(m["passed"] for m in per_profile.values()),
        "max_abs_err": max(m["max_abs_err"] for m in per_profile.values()),
        "atol": section.compare_atol,
        "rtol": section.compare_rtol,
        "reference": f"{reference.parent.name}/{reference.name}",
        "profiles": per_profile,
    }


def compare_engine(
    runner, reference: Path, feeds: Sequence[dict[str, np.ndarray]], section: TrtSection
) -> dict:
    """Polygraphy: ``runner`` (the engine) vs ``OnnxrtRunner`` on ``reference``, on the same feeds.

    Each runner is fed only the inputs it has (Polygraphy drops the others), e.g. an engine whose
    plugin ignores ``stats_threshold``.
    """
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator, SimpleCompareFunc
    from polygraphy.logger import G_LOGGER

    onnxrt = OnnxrtRunner(SessionFromOnnx(str(reference), providers=["CPUExecutionProvider"]))
    with G_LOGGER.verbosity(G_LOGGER.ERROR), np.errstate(divide="ignore", invalid="ignore"):
        results = Comparator.run([runner, onnxrt], data_loader=list(feeds))
        passed = bool(
            Comparator.compare_accuracy(
                results, compare_func=SimpleCompareFunc(atol=section.compare_atol, rtol=section.compare_rtol)
            )
        )
    (_, engine_iters), (_, ort_iters) = results
    missing = sorted(set(ort_iters[0]) - set(engine_iters[0]))
    if missing:
        raise StageError(f"engine {runner.name} lacks output(s) {missing} of {reference.name}")
    err = max(
        (
            float(np.abs(engine_iters[0][k].astype(np.float64) - v.astype(np.float64)).max(initial=0.0))
            for k, v in ort_iters[0].items()
        ),
        default=0.0,
    )
    return {"passed": passed, "max_abs_err": err, "atol": section.compare_atol, "rtol": section.compare_rtol}
