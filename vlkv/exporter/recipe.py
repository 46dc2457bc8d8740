"""A build recipe: nested dataclasses resolved from defaults → YAML → ``--set a.b=c`` overrides.

Every section checks its own invariants in ``__post_init__`` and raises ``ValueError("field: ...")``;
:func:`recipe_from_dict` prefixes the dotted path, so every problem surfaces as one
:class:`RecipeError` line such as ``policy.budget: must be in (0, 1], got 1.5``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

DTYPES = ("float32", "float16", "bfloat16")
FAMILIES = ("llava", "llava_next", "qwen2_vl")
# Built-in model names resolve through vlkv.runtime.models, never through the filesystem.
BUILTIN_MODELS: dict[str, str] = {
    "tiny-llava": "llava",
    "tiny-llava-next": "llava_next",
    "tiny-qwen2-vl": "qwen2_vl",
    "smollm2-llava": "llava",
    "smollm2-llava-random": "llava",
}
# Kept here (not imported from stages.py) so that a recipe can be validated without the stage code;
# stages.py asserts that its registry has exactly these names, in this order.
STAGE_NAMES = (
    "vision_onnx",
    "decoder_onnx",
    "plugin_graph",
    "trt_engine",
    "trtllm_checkpoint",
    "trtllm_engine",
)
# HF ``model_type`` → family, for checkpoints on disk.
_MODEL_TYPES = {"llava": "llava", "llava_next": "llava_next", "qwen2_vl": "qwen2_vl"}


TRTLLM_FLOWS = ("build", "serve")


class RecipeError(ValueError):
    """A recipe problem, always one line naming the dotted key (or the file) at fault."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_range3(name: str, values: list[int], low: int = 0) -> None:
    _require(len(values) == 3, f"{name}: expected [min, opt, max], got {values}")
    _require(min(values) >= low, f"{name}: sizes must be >= {low}, got {values}")
    _require(values[0] <= values[1] <= values[2], f"{name}: need min <= opt <= max, got {values}")


def _check_min_opt_max(section: object, what: str, low: int) -> None:
    lo, opt, hi = (getattr(section, f"{k}_{what}") for k in ("min", "opt", "max"))
    _require(lo >= low, f"min_{what}: must be >= {low}, got {lo}")
    _require(hi >= lo, f"max_{what}: must be >= min_{what}={lo}, got {hi}")
    _require(lo <= opt <= hi, f"opt_{what}: must be in [min_{what}, max_{what}] = [{lo}, {hi}], got {opt}")


@dataclass
class ModelSection:
    """Which model to export: a built-in name (see ``BUILTIN_MODELS``) or a local checkpoint directory.

    Relative paths are resolved against the current directory; hub ids are not downloaded.
    ``family="auto"`` is replaced by the family of the built-in or of ``config.json``'s model_type.
    """

    name_or_path: str = "tiny-llava"
    family: str = "auto"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _require(
            self.family in ("auto", *FAMILIES),
            f"family: must be one of auto, {', '.join(FAMILIES)}, got {self.family!r}",
        )
        if self.name_or_path in BUILTIN_MODELS:
            detected = BUILTIN_MODELS[self.name_or_path]
        else:
            path = Path(self.name_or_path)
            _require(
                path.is_dir(),
                f"name_or_path: checkpoint path '{self.name_or_path}' does not exist "
                f"(built-in names: {', '.join(BUILTIN_MODELS)})",
            )
            detected = _family_from_config(path)
        if self.family == "auto":
            _require(
                detected is not None, f"family: cannot infer it from {self.name_or_path}/config.json; set it"
            )
            self.family = detected
        elif detected is not None:
            _require(
                detected == self.family,
                f"family: {self.name_or_path} is a {detected} model, not {self.family}",
            )

    @property
    def is_builtin(self) -> bool:
        return self.name_or_path in BUILTIN_MODELS


def _family_from_config(path: Path) -> str | None:
    config = path / "config.json"
    if not config.is_file():
        return None
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"name_or_path: cannot read {config}: {exc}") from None
    return _MODEL_TYPES.get(model_type)


@dataclass
class VisionSection:
    """Vision tower + projector export.

    LLaVA(-NeXT) inputs are ``(batch, 3, H, W)`` images (for LLaVA-NeXT, batch counts anyres crops);
    the batch profile is ``min/opt/max_batch``. Qwen2-VL inputs are flattened patches; their profile is
    ``min/opt/max_patches`` and ``sample_grid_thw`` is the (t, h, w) patch grid used for export/validation.
    ``tolerance`` is the ONNX Runtime vs PyTorch max-abs-error bound (null: a per-dtype default).
    """

    opset: int = 17
    dynamic_batch: bool = True
    min_batch: int = 1
    opt_batch: int = 1
    max_batch: int = 4
    min_patches: int = 16
    opt_patches: int = 256
    max_patches: int = 1296
    sample_grid_thw: list[int] = field(default_factory=lambda: [1, 8, 8])
    tolerance: float | None = None

    def __post_init__(self) -> None:
        _require(14 <= self.opset <= 20, f"opset: must be in [14, 20] (legacy exporter), got {self.opset}")
        _check_min_opt_max(self, "batch", low=1)
        _check_min_opt_max(self, "patches", low=1)
        _require(
            len(self.sample_grid_thw) == 3 and min(self.sample_grid_thw) >= 1,
            f"sample_grid_thw: expected three positive ints [t, h, w], got {self.sample_grid_thw}",
        )
        _require(
            self.tolerance is None or self.tolerance > 0,
            f"tolerance: must be > 0 or null, got {self.tolerance}",
        )


@dataclass
class ProfileSection:
    """One TensorRT optimisation profile: ``dims`` maps an ONNX dim name to ``[min, opt, max]``.

    Dim names are the symbolic names of the decoder graph (``batch_size``, ``sequence_length``,
    ``past_sequence_length``, ``logits_rows``); sums such as ``past_sequence_length + sequence_length``
    are derived, and per-layer names (``past_sequence_length_3``) default to the shared one.
    """

    name: str = "default"
    dims: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _require(bool(self.name), "name: must be a non-empty string")
        for dim, values in self.dims.items():
            _require(isinstance(values, list), f"dims.{dim}: expected [min, opt, max], got {values!r}")
            _require(
                all(isinstance(v, int) and not isinstance(v, bool) for v in values),
                f"dims.{dim}: expected integers, got {values}",
            )
            _check_range3(f"dims.{dim}", values)


@dataclass
class DecoderSection:
    """Decoder export limits; empty ``profiles`` become a prefill and a decode profile over these limits."""

    opset: int = 17
    max_batch: int = 1
    max_seq: int = 2048
    profiles: list[ProfileSection] = field(default_factory=list)

    def __post_init__(self) -> None:
        _require(14 <= self.opset <= 20, f"opset: must be in [14, 20] (legacy exporter), got {self.opset}")
        _require(self.max_batch >= 1, f"max_batch: must be >= 1, got {self.max_batch}")
        _require(self.max_seq >= 2, f"max_seq: must be >= 2, got {self.max_seq}")
        if not self.profiles:
            self.profiles = default_profiles(self.max_batch, self.max_seq)
        names = [p.name for p in self.profiles]
        _require(len(set(names)) == len(names), f"profiles: names must be unique, got {names}")
        for i, profile in enumerate(self.profiles):
            batch = profile.dims.get("batch_size", [1, 1, 1])
            _require(
                batch[2] <= self.max_batch,
                f"profiles.{i}.dims.batch_size: max exceeds max_batch={self.max_batch}",
            )
            for dim in ("sequence_length", "past_sequence_length", "logits_rows"):
                top = profile.dims.get(dim, [0, 0, 0])[2]
                _require(top <= self.max_seq, f"profiles.{i}.dims.{dim}: max exceeds max_seq={self.max_seq}")


def default_profiles(max_batch: int, max_seq: int) -> list[ProfileSection]:
    """A prefill profile (no past) and a decode profile (one new token over up to max_seq - 1 past).

    ``logits_rows`` is how many rows' logits the decoder graph returns (the last row, or all rows).
    """
    batch = [1, max(1, max_batch // 2), max_batch]
    prefill = {
        "batch_size": batch,
        "sequence_length": [1, max_seq // 2, max_seq],
        "past_sequence_length": [0, 0, 0],
        "logits_rows": [1, 1, max_seq],
    }
    decode = {
        "batch_size": batch,
        "sequence_length": [1, 1, 1],
        "past_sequence_length": [1, max_seq // 2, max_seq - 1],
        "logits_rows": [1, 1, 1],
    }
    return [ProfileSection("prefill", prefill), ProfileSection("decode", decode)]


@dataclass
class PolicySection:
    """KV-cache policy baked into the exported graphs: a name from the runtime registry + its budget.

    ``budget`` is the retained fraction of the cache (methods.md §1c: budget b = 1 - pruned ratio).
    """

    name: str = "full"
    budget: float = 1.0
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _require(0.0 < self.budget <= 1.0, f"budget: must be in (0, 1], got {self.budget}")
        registry = _policy_registry()
        if registry is None:
            _require(bool(self.name), "name: must be a non-empty string")
            return
        known = list(registry.POLICIES)
        _require(self.name in known, f"name: unknown policy {self.name!r}; known: {', '.join(known)}")
        _require("budget" not in self.options, "options.budget: set policy.budget instead")
        fields = [f for f in registry.policy_fields(self.name) if f != "budget"]
        hints = typing.get_type_hints(registry.POLICIES[self.name])
        for key, value in self.options.items():
            _require(
                key in fields,
                f"options.{key}: unknown option for policy {self.name!r}; known: {', '.join(sorted(fields))}",
            )
            if key in hints:
                _check_option_type(f"options.{key}", value, hints[key])
        # The policy checks its own option values (ranges, allocator combinations) as the runtime will.
        # The budget is left out: it is checked above, and `full` ignores it.
        try:
            registry.make_policy(self.name, **self.options)
        except (TypeError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"options: policy {self.name!r} rejects {self.options}: {first}") from None


def _check_option_type(key: str, value: object, hint: object) -> None:
    """``value`` against a policy field's annotation (int, float, bool, str, or ``X | None``)."""
    allowed = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    for kind in allowed:
        if kind is type(None) and value is None:
            return
        if kind is bool and isinstance(value, bool):
            return
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return
        if kind is str and isinstance(value, str):
            return
        if kind not in (type(None), bool, int, float, str):
            return  # a type the recipe cannot check; the policy itself validates it
    names = " or ".join("null" if k is type(None) else k.__name__ for k in allowed)
    raise ValueError(f"{key}: expected {names}, got {value!r}")


def _policy_registry():
    """The runtime's policy registry module, or None when the runtime cannot be imported here."""
    try:
        from vlkv.runtime.policies import registry
    except ImportError:
        return None
    return registry


@dataclass
class TrtSection:
    """TensorRT builder settings (used only where TensorRT is installed).

    ``ptx_arch`` is the GPU architecture the vlkv plugin kernels are compiled for (one of
    ``vlkv.plugins.ptx.SM_ARCHES``); null takes it from the GPU of the machine that builds the engine.
    """

    fp16: bool = True
    workspace_gb: float = 4.0
    builder_opt_level: int = 3
    compare_atol: float = 1e-2
    compare_rtol: float = 1e-2
    # GPU the plugin kernels' PTX is compiled for ("sm_90"); null = the build machine's GPU.
    ptx_arch: str | None = None

    def __post_init__(self) -> None:
        if self.ptx_arch is not None:
            from vlkv.plugins.ptx import SM_ARCHES

            _require(
                self.ptx_arch in SM_ARCHES,
                f"ptx_arch: must be one of {', '.join(SM_ARCHES)} or null (the build GPU), got {self.ptx_arch!r}",
            )
        _require(self.workspace_gb > 0, f"workspace_gb: must be > 0, got {self.workspace_gb}")
        _require(
            0 <= self.builder_opt_level <= 5,
            f"builder_opt_level: must be in [0, 5], got {self.builder_opt_level}",
        )
        _require(self.compare_atol >= 0, f"compare_atol: must be >= 0, got {self.compare_atol}")
        _require(self.compare_rtol >= 0, f"compare_rtol: must be >= 0, got {self.compare_rtol}")


@dataclass
class TrtllmSection:
    """TensorRT-LLM limits and parallelism; ``max_multimodal_len`` 0 means max_batch × visual tokens.

    ``flow`` picks the TensorRT-LLM generation (docs/trtllm.md): ``build`` writes a sharded legacy
    checkpoint for ``trtllm-build`` (TensorRT-LLM ≤ 1.2); ``serve`` writes the Hugging Face checkpoint
    and the ``trtllm-serve`` command line (later releases, which dropped the legacy flow).
    """

    enabled: bool = True
    flow: str = "build"
    tp_size: int = 1
    pp_size: int = 1
    max_batch_size: int = 1
    max_input_len: int = 2048
    max_seq_len: int = 2560
    max_multimodal_len: int = 0

    def __post_init__(self) -> None:
        _require(
            self.flow in TRTLLM_FLOWS, f"flow: must be one of {', '.join(TRTLLM_FLOWS)}, got {self.flow!r}"
        )
        for name in ("tp_size", "pp_size", "max_batch_size", "max_input_len", "max_seq_len"):
            _require(getattr(self, name) >= 1, f"{name}: must be >= 1, got {getattr(self, name)}")
        _require(
            self.max_multimodal_len >= 0, f"max_multimodal_len: must be >= 0, got {self.max_multimodal_len}"
        )
        _require(
            self.max_seq_len >= self.max_input_len,
            f"max_seq_len: must be >= max_input_len={self.max_input_len}, got {self.max_seq_len}",
        )


@dataclass
class Recipe:
    """Everything a build needs; see ``recipes/*.yaml`` for annotated examples."""

    model: ModelSection = field(default_factory=ModelSection)
    vision: VisionSection = field(default_factory=VisionSection)
    decoder: DecoderSection = field(default_factory=DecoderSection)
    policy: PolicySection = field(default_factory=PolicySection)
    plugins: list[str] = field(default_factory=list)
    trt: TrtSection = field(default_factory=TrtSection)
    trtllm: TrtllmSection = field(default_factory=TrtllmSection)
    stages: list[str] = field(default_factory=lambda: list(STAGE_NAMES))

    def __post_init__(self) -> None:
        _require(all(p for p in self.plugins), f"plugins: names must be non-empty, got {self.plugins}")
        _require(len(set(self.plugins)) == len(self.plugins), f"plugins: duplicate names in {self.plugins}")
        for i, stage in enumerate(self.stages):
            _require(
                stage in STAGE_NAMES, f"stages.{i}: unknown stage {stage!r}; known: {', '.join(STAGE_NAMES)}"
            )
        _require(len(set(self.stages)) == len(self.stages), f"stages: duplicate names in {self.stages}")
        # Stages always run in dependency order, whatever order the YAML lists them in.
        self.stages = [s for s in STAGE_NAMES if s in self.stages]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self, path: str | Path | None = None) -> str:
        """The resolved recipe as YAML (written to ``path`` when given); it reloads to an equal Recipe."""
        text = yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)
        if path is not None:
            Path(path).write_text(text)
        return text

    def config_hash(self, sections: tuple[str, ...] | None = None) -> str:
        """sha256 of the canonical JSON of the whole recipe, or of only the named top-level sections."""
        data = self.to_dict()
        if sections is not None:
            data = {name: data[name] for name in sections}
        blob = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()
