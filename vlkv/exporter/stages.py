"""The build stages, their explicit registry, and :func:`run_stages`.

A stage is a function ``run(recipe, src_dir, out_dir) -> out_dir``. ``src_dir`` is the build root,
where every stage owns the sub-directory named after it (``<root>/vision_onnx/``, ...), so a stage
reads its upstream outputs from ``src_dir / upstream_name``. :func:`run_stages` wraps each stage:
it skips a stage whose manifest still matches, otherwise empties its directory, runs it, and writes
``manifest.json`` last.

Stage hooks written elsewhere (imported lazily, failing with one line while they are absent):

- ``vlkv.exporter.decoder_onnx.export(recipe, out_dir)`` writes ``decoder.onnx`` into ``out_dir``, copied
  from the ONNX export cache, whose entry :func:`vlkv.exporter.export_cache.stage_export` verifies.
- ``vlkv.exporter.graph_rewrite.rewrite(recipe, decoder_dir, out_dir)`` reads ``decoder_dir/decoder.onnx``
  and writes the plugin-rewritten ``decoder.onnx`` into ``out_dir``.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vlkv.exporter.errors import StageError, StageSkipped
from vlkv.exporter.manifest import (
    Manifest,
    files_digest,
    output_files,
    package_versions,
    read_manifest,
    stale_reason,
)
from vlkv.exporter.recipe import STAGE_NAMES, Recipe, RecipeError

METRICS = "metrics.json"
DECODER_FILE = "decoder.onnx"
StageFn = Callable[[Recipe, Path, Path], Path]


def _vision_onnx(recipe: Recipe, src_dir: Path, out_dir: Path) -> Path:
    from vlkv.exporter import vision_onnx

    return vision_onnx.run(recipe, src_dir, out_dir)


def _decoder_onnx(recipe: Recipe, src_dir: Path, out_dir: Path) -> Path:
    from vlkv.exporter import export_cache

    export = _hook("vlkv.exporter.decoder_onnx", "export", "decoder_onnx")
    # The export comes from the shared ONNX export cache: its entry is checksummed here, and a corrupt
    # one is rebuilt (export_cache.stage_export).
    cache = export_cache.stage_export(lambda: export(recipe, out_dir), out_dir, DECODER_FILE)
    metrics_path = out_dir / METRICS
    metrics = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {}
    metrics["export_cache"] = cache
    metrics_path.write_text(json.dumps(metrics, indent=2))
    return out_dir


def _plugin_graph(recipe: Recipe, src_dir: Path, out_dir: Path) -> Path:
    _hook("vlkv.exporter.graph_rewrite", "rewrite", "plugin_graph")(recipe, src_dir / "decoder_onnx", out_dir)
    return out_dir


def _trt_engine(recipe: Recipe, src_dir: Path, out_dir: Path) -> Path:
    from vlkv.exporter import trt_engine

    return trt_engine.run(recipe, src_dir, out_dir)


def _trtllm_checkpoint(recipe: Recipe, src_dir: Path, out_dir: Path) -> Path:
    from vlkv.exporter import trtllm_checkpoint

    return trtllm_checkpoint.run(recipe, src_dir, out_dir)


def _trtllm_engine(recipe: Recipe, src_dir: Path, out_dir: Path) -> Path:
    from vlkv.exporter import trtllm_engine

    return trtllm_engine.run(recipe, src_dir, out_dir)


def _hook(module: str, function: str, stage: str) -> Callable:
    """``module.function``, or a one-line StageError while that module (or function) is not written."""
    try:
        found = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            raise StageError(f"{module} is not available yet, so stage {stage} cannot run") from None
        raise StageError(f"{module} needs the missing module {exc.name!r}") from None
    if not callable(getattr(found, function, None)):
        raise StageError(f"{module}.{function}() is not available yet, so stage {stage} cannot run")
    return getattr(found, function)


@dataclass(frozen=True)
class Stage:
    """A registered stage.

    ``depends`` names the recipe sections whose hash decides whether outputs are current.
    ``upstream`` stages must have succeeded; ``optional`` ones count as upstream only when the
    recipe's stage list includes them (e.g. trt_engine builds a decoder engine only for recipes that
    export a decoder). ``trtllm_track`` stages are disabled by ``trtllm.enabled: false``.
    """

    name: str
    run: StageFn
    depends: tuple[str, ...]
    upstream: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    trtllm_track: bool = False


STAGES: dict[str, Stage] = {
    "vision_onnx": Stage("vision_onnx", _vision_onnx, ("model", "vision")),
    "decoder_onnx": Stage("decoder_onnx", _decoder_onnx, ("model", "decoder", "policy")),
    "plugin_graph": Stage(
        "plugin_graph", _plugin_graph, ("model", "decoder", "policy", "plugins"), upstream=("decoder_onnx",)
    ),
    "trt_engine": Stage(
        "trt_engine",
        _trt_engine,
        ("model", "vision", "decoder", "policy", "plugins", "trt"),
        upstream=("vision_onnx",),
        optional=("decoder_onnx", "plugin_graph"),
    ),
    "trtllm_checkpoint": Stage(
        "trtllm_checkpoint", _trtllm_checkpoint, ("model", "trtllm"), trtllm_track=True
    ),  # tp/pp size and flow change what it writes
    "trtllm_engine": Stage(
        "trtllm_engine",
        _trtllm_engine,
        ("model", "vision", "trt", "trtllm"),
        upstream=("trtllm_checkpoint",),
        optional=("vision_onnx", "trt_engine"),
        trtllm_track=True,
    ),
}
assert tuple(STAGES) == STAGE_NAMES, "recipe.STAGE_NAMES and STAGES must list the same stages in order"

# Statuses that leave usable outputs behind for downstream stages.
OK_STATUSES = ("ran", "skipped")


@dataclass
class StageResult:
    """Outcome of one stage: ran | skipped (up to date) | unavailable (StageSkipped) | failed | blocked | disabled."""

    name: str
    status: str
    detail: str = ""
    seconds: float = 0.0


@dataclass
class RunReport:
    """Per-stage results of :func:`run_stages`, in execution order."""

    out_dir: Path
    results: list[StageResult] = field(default_factory=list)

    def names(self, status: str) -> list[str]:
        return [r.name for r in self.results if r.status == status]

    @property
    def ran(self) -> list[str]:
        return self.names("ran")

    @property
    def skipped(self) -> list[str]:
        return self.names("skipped")

    @property
    def failed(self) -> list[str]:
        return self.names("failed") + self.names("blocked")

    @property
    def unavailable(self) -> list[str]:
        return self.names("unavailable")

    def status(self, name: str) -> str | None:
        return next((r.status for r in self.results if r.name == name), None)


def run_stages(
    recipe: Recipe, out_dir: str | Path, only: Sequence[str] | None = None, progress: bool = True
) -> RunReport:
    """Run the recipe's stages (or just ``only``) under ``out_dir``, skipping those already up to date.

    A failing stage does not stop independent stages; stages downstream of it are ``blocked``.
    With ``only``, upstream outputs must already be on disk (a previous build). The whole run holds
    ``out_dir``'s build lock (:mod:`vlkv.exporter.build_lock`): a second concurrent run raises
    ``BuildLocked`` before touching anything.
    """
    from tqdm import tqdm

    from vlkv.exporter import export_cache
    from vlkv.exporter.build_lock import build_lock

    root = Path(out_dir)
    plan = list(recipe.stages) if only is None else _check_only(only)
    with build_lock(root):
        # Folders left by exports that were killed mid-way (no live process holds them).
        for path in export_cache.clean_stale_temps(export_cache.cache_root()):
            export_cache.log.warning(f"removed the stale export folder {path} (its writer is gone)")
        report = RunReport(root)
        versions = package_versions()
        bar = tqdm(
            plan, desc="build-engine", unit="stage", disable=not progress, file=sys.stderr, leave=False
        )
        for name in bar:
            bar.set_postfix_str(name)
            report.results.append(_run_one(STAGES[name], recipe, root, report, versions))
        bar.close()
    return report


def _check_only(only: Sequence[str]) -> list[str]:
    for name in only:
        if name not in STAGES:
            raise RecipeError(f"--stage {name}: unknown stage; known: {', '.join(STAGES)}")
    return [s for s in STAGES if s in only]


def _run_one(stage: Stage, recipe: Recipe, root: Path, report: RunReport, versions: dict) -> StageResult:
    start = time.perf_counter()
    if stage.trtllm_track and not recipe.trtllm.enabled:
        return StageResult(stage.name, "disabled", "trtllm.enabled is false")
    inputs, problem = _upstream_inputs(stage, recipe, root, report)
    if problem is not None:
        status, detail = problem
        return StageResult(stage.name, status, detail)
    out_dir = root / stage.name
    config_hash = recipe.config_hash(stage.depends)
    reason = stale_reason(out_dir, stage.name, config_hash, inputs, versions)
    if reason is None:
        return StageResult(stage.name, "skipped", "up to date")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    try:
        stage.run(recipe, root, out_dir)
    except StageSkipped as exc:
        return StageResult(stage.name, "unavailable", str(exc), time.perf_counter() - start)
    except (StageError, RecipeError) as exc:
        return StageResult(stage.name, "failed", str(exc), time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - the CLI promises one line, never a traceback
        if os.environ.get("VLKV_DEBUG"):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        detail = f"{type(exc).__name__}: {first} (set VLKV_DEBUG=1 for the traceback)"
        return StageResult(stage.name, "failed", detail, time.perf_counter() - start)
    files = output_files(out_dir)
    metrics = json.loads((out_dir / METRICS).read_text()) if (out_dir / METRICS).is_file() else {}
    Manifest(stage.name, config_hash, versions, inputs, files, metrics).write(out_dir)
    return StageResult(stage.name, "ran", f"{reason}; {len(files)} files", time.perf_counter() - start)


def _upstream_inputs(
    stage: Stage, recipe: Recipe, root: Path, report: RunReport
) -> tuple[dict[str, str], tuple[str, str] | None]:
    """Digests of upstream outputs, or (status, detail) when an upstream is not usable.

    An upstream that is ``unavailable`` (TensorRT missing) makes a required dependant unavailable too,
    and is simply left out for an optional one (trtllm_engine still lays out the LLM side), as is an
    optional upstream that is neither in this run nor on disk.
    """
    needed = list(stage.upstream) + [s for s in stage.optional if s in recipe.stages]
    inputs: dict[str, str] = {}
    for name in needed:
        status = report.status(name)
        if status == "unavailable" and name in stage.optional:
            continue
        if status == "unavailable":
            return {}, ("unavailable", f"needs {name}, which is unavailable on this machine")
        if status is not None and status not in OK_STATUSES:
            return {}, ("blocked", f"needs {name}, which is {status}")
        manifest = read_manifest(root / name)
        if manifest is None and name in stage.optional and status is None:
            continue  # with --stage: an optional upstream never built here (e.g. no TensorRT) is left out
        if manifest is None:
            return {}, ("failed", f"needs the outputs of {name} in {root / name}; run that stage first")
        inputs[name] = files_digest(manifest.files)
    return inputs, None
