"""A stand-in for ``tensorrt`` + ``tensorrt.plugin`` that enforces the QDP decorator contract.

TensorRT cannot be installed here (toolchain.md A1), so ``vlkv.plugins.trt_plugins`` runs against this
double. It checks what TensorRT's own ``tensorrt/plugin/_validate.py`` checks when a callback is
decorated (NVIDIA/TensorRT, python/packaging/bindings_wheel/tensorrt/plugin/_validate.py and _lib.py;
docs: tensorrt.plugin.register / autotune / aot_impl), so a callback TensorRT would reject at
registration fails here too:

- ``register``: "ns::name" without dots, not a reserved namespace, registered once; every argument
  annotated, positional-or-keyword or keyword-only, no defaults; TensorDesc arguments first, then
  attributes of type int / float / str / bool / bytes, none named outputs / stream / tactic; a return
  annotation that is TensorDesc or ``tuple[TensorDesc, ...]`` spelled out.
- ``autotune``: arguments ``(inputs..., some attrs in registration order..., outputs)``; annotated
  attributes must match their registered type; the return annotation, when given, is
  AutoTuneCombination or ``list[AutoTuneCombination]``.
- ``aot_impl``: arguments ``(inputs..., some attrs..., outputs, tactic)``; the return annotation is
  mandatory: ``tuple[str | bytes, str | bytes, KernelLaunchParams, SymExprs subclass]``.

Beyond decoration, :meth:`Qdp.run_autotune` / :meth:`Qdp.run_aot` call a plugin's callbacks the way a
build does and check what they return (one type per I/O, valid type names, the AOT 4-tuple).
Shape expressions are plain ints.
"""

from __future__ import annotations

import inspect
import types
import typing
from dataclasses import dataclass, field

RESERVED_NAMESPACES = {"", "trt", "tensorrt", "std"}
DISALLOWED_ATTR_NAMES = {"outputs", "stream", "tactic"}
ATTR_TYPES = (int, float, bytes, bool, str)
# trt.DataType names accepted in AutoTuneCombination strings ("FP32"/"FP16" are aliases).
TYPE_NAMES = {"FP32", "FP16", "BF16", "FLOAT", "HALF", "INT8", "INT32", "INT64", "BOOL", "UINT8", "FP8"}
FORMAT_NAMES = {"LINEAR", "CHW2", "HWC8", "CHW4", "CHW16", "CHW32", "DHWC8", "CDHW32", "HWC", "DLA_LINEAR"}


class DataType(str):
    """``trt.DataType`` members print as "DataType.HALF"; ptx.normalize_dtype reads that spelling."""


FLOAT32, FLOAT16, BFLOAT16, INT64 = (DataType(f"DataType.{n}") for n in ("FLOAT", "HALF", "BF16", "INT64"))


class TensorDesc:
    """Descriptor with int shape expressions."""

    def __init__(self, shape_expr=(), dtype=None):
        self.shape_expr, self.dtype = tuple(shape_expr), dtype

    def like(self) -> TensorDesc:
        return TensorDesc(self.shape_expr, self.dtype)


class KernelLaunchParams:
    """Only the documented fields can be set."""

    FIELDS = ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shared_mem")

    def __init__(self):
        for name in self.FIELDS:
            object.__setattr__(self, name, 1 if name != "shared_mem" else 0)

    def __setattr__(self, name, value):
        if name not in self.FIELDS:
            raise AttributeError(f"KernelLaunchParams has no field {name!r}")
        object.__setattr__(self, name, value)


class SymExprs:
    def __init__(self, values=()):
        self.values = tuple(values)

    @classmethod
    def from_tuple(cls, values):
        return cls(values)


class SymIntExprs(SymExprs):
    @classmethod
    def from_tuple(cls, values):
        bad = [v for v in values if not isinstance(v, SymInt32)]
        if bad:
            raise ValueError(f"SymIntExprs.from_tuple takes SymInt32 values, got {bad}")
        return cls(values)


@dataclass(frozen=True)
class SymInt32:
    value: int


class AutoTuneCombination:
    """Parses "T0, T1|T2, ..." like TensorRT: known names, one separator kind, equal dependent counts."""

    def __init__(self, io_types: str | None = None, layouts: str | None = None, tactics=None):
        self.io_types = [s.strip() for s in io_types.split(",")] if io_types is not None else []
        self.layouts = [s.strip() for s in (layouts or "LINEAR").split(",")]
        if len(self.layouts) > 1 and len(self.layouts) != len(self.io_types):
            raise ValueError(f"{len(self.layouts)} layouts for {len(self.io_types)} I/O types")
        _check_variants(self.io_types, TYPE_NAMES, "type")
        _check_variants(self.layouts, FORMAT_NAMES, "format")
        if tactics is not None and any(not isinstance(t, int) or t <= 0 for t in tactics):
            raise ValueError(f"custom tactics must be positive ints, got {tactics}")


def _check_variants(variants: list[str], known: set[str], what: str) -> None:
    dependent = 0
    for variant in variants:
        if "|" in variant and "*" in variant:
            raise ValueError(f"{what} '{variant}' contains both '|' and '*'")
        options = variant.replace("*", "|").split("|")
        unknown = [o for o in options if o not in known]
        if unknown:
            raise ValueError(f"unknown {what} name(s) {unknown} in '{variant}'")
        if "|" in variant:
            if dependent > 1 and dependent != len(options):
                raise ValueError(f"{what} combinations {variants} contain illegal dependent lengths")
            dependent = max(dependent, len(options))


@dataclass
class PluginDef:
    tensor_names: list[str]
    attrs: dict[str, type]
    num_outputs: int
    register: typing.Callable
    autotune: typing.Callable | None = None
    aot_impl: typing.Callable | None = None
    autotune_attrs: list[str] = field(default_factory=list)
    aot_attrs: list[str] = field(default_factory=list)


def _is_class(annotation, base) -> bool:
    if isinstance(annotation, str):
        # TensorRT calls issubclass() on annotations: a string (``from __future__ import annotations``)
        # makes that a TypeError at registration.
        raise ValueError(f"annotation {annotation!r} is a string; tensorrt.plugin needs the objects")
    return inspect.isclass(annotation) and issubclass(annotation, base)


class Qdp:
    """The decorators and helper types of ``tensorrt.plugin``, with a registry per instance."""

    TensorDesc, KernelLaunchParams, SymExprs, SymIntExprs = (
        TensorDesc,
        KernelLaunchParams,
        SymExprs,
        SymIntExprs,
    )
    SymInt32, AutoTuneCombination = SymInt32, AutoTuneCombination

    def __init__(self):
        self.registry: dict[str, PluginDef] = {}

    @staticmethod
    def from_shape_expr(shape, dtype):
        return TensorDesc(shape, dtype)

    @staticmethod
    def cdiv(a, b):
        return -(-a // b)

    # ------------------------------------------------------------------ decorators
    def register(self, plugin_id: str, lazy_register: bool = False):
        def decorator(fn):
            ns, _, name = plugin_id.partition("::")
            if not name or "." in ns or "." in name or ns in RESERVED_NAMESPACES:
                raise ValueError(f"bad plugin id {plugin_id!r}")
            if plugin_id in self.registry:
                raise ValueError(f"'{plugin_id}' is already registered")
            sig = inspect.signature(fn)
            tensors, attrs = [], {}
            for idx, (arg, param) in enumerate(sig.parameters.items()):
                if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
                    raise ValueError(f"Argument {arg} is not a positional-or-keyword or keyword-only arg")
                if param.annotation is param.empty:
                    raise ValueError(f"Argument {arg} does not have a type annotation")
                if param.default is not param.empty:
                    raise ValueError(f"Argument {arg} has a default value")
                if _is_class(param.annotation, TensorDesc):
                    if attrs:
                        raise ValueError("TensorDescs args and attribute args cannot be interspersed")
                    tensors.append(arg)
                    continue
                if idx == 0:
                    raise ValueError("TensorDescs args should come first, followed by attributes")
                if arg in DISALLOWED_ATTR_NAMES:
                    raise ValueError(f"'{arg}' is not allowed as a plugin attribute name")
                if param.annotation not in ATTR_TYPES:
                    raise ValueError(f"Attribute '{arg}' of type {param.annotation} is not serializable")
                attrs[arg] = param.annotation
            ret = sig.return_annotation
            if ret is sig.empty:
                raise ValueError(
                    f"No return annotation found for register function. Received signature {sig}."
                )
            if typing.get_origin(ret) is tuple:
                outs = typing.get_args(ret)
                if not outs or not all(_is_class(a, TensorDesc) for a in outs):
                    raise ValueError(f"Return types can only be TensorDesc or Tuple[TensorDesc], got {ret}")
                num_outputs = len(outs)
            elif _is_class(ret, TensorDesc):
                num_outputs = 1
            else:
                raise ValueError(f"Return types can only be TensorDesc or Tuple[TensorDesc], got {ret}")
            self.registry[plugin_id] = PluginDef(tensors, attrs, num_outputs, fn)
            return fn

        return decorator

    def autotune(self, plugin_id: str):
        def decorator(fn):
            plugin = self._registered(plugin_id)
            plugin.autotune_attrs = self._check_args(fn, plugin, ["outputs"], "autotune")
            ret = inspect.signature(fn).return_annotation
            if ret is not inspect.Signature.empty:
                args = typing.get_args(ret) if typing.get_origin(ret) is list else (ret,)
                if not all(_is_class(a, AutoTuneCombination) for a in args):
                    raise ValueError(f"Return types can only be AutoTuneCombination or List[...], got {ret}")
            plugin.autotune = fn
            return fn

        return decorator

    def aot_impl(self, plugin_id: str):
        def decorator(fn):
            plugin = self._registered(plugin_id)
            plugin.aot_attrs = self._check_args(fn, plugin, ["outputs", "tactic"], "aot_impl")
            sig = inspect.signature(fn)
            ret = sig.return_annotation
            if ret is sig.empty:
                raise ValueError(
                    f"No return annotation found for aot_impl function. Received signature {sig}."
                )
            args = typing.get_args(ret)
            if typing.get_origin(ret) is not tuple or len(args) != 4:
                raise ValueError(f"Return annotation is {ret}; expected a 4-tuple")
            for index in (0, 1):
                union = typing.get_origin(args[index]) in (typing.Union, types.UnionType)
                for arg in typing.get_args(args[index]) if union else (args[index],):
                    if arg is not str and arg is not bytes:
                        raise ValueError(f"Return annotation for argument at {index} is '{arg}'")
            if not _is_class(args[2], KernelLaunchParams):
                raise ValueError(f"Argument at index 2 of return annotation is '{args[2]}'")
            if not _is_class(args[3], SymExprs):
                raise ValueError(f"Argument at index 3 of return annotation is '{args[3]}'")
            plugin.aot_impl = fn
            return fn

        return decorator

    def _registered(self, plugin_id: str) -> PluginDef:
        if plugin_id not in self.registry:
            raise ValueError(f"Plugin {plugin_id} is not registered")
        return self.registry[plugin_id]

    @staticmethod
    def _check_args(fn, plugin: PluginDef, tail: list[str], what: str) -> list[str]:
        """TensorRT's schema check: ``(tensors..., attr subset in registration order..., *tail)``."""
        sig = inspect.signature(fn)
        used = []
        for arg, param in sig.parameters.items():
            if arg in plugin.attrs:
                used.append(arg)
            if param.annotation is param.empty or arg in tail:
                continue
            if arg in plugin.attrs:
                if param.annotation is not plugin.attrs[arg]:
                    raise ValueError(
                        f"Attribute '{arg}' has a type annotation different from the registration"
                    )
            elif not _is_class(param.annotation, TensorDesc) or arg not in plugin.tensor_names:
                raise ValueError(f"Unexpected argument '{arg}' in {what} function")
        attrs = [a for a in plugin.attrs if a in used]
        expected = ", ".join([*plugin.tensor_names, *attrs, *tail])
        if ", ".join(sig.parameters) != expected:
            raise ValueError(f"Signature of the {what} function {sig} does not match ({expected})")
        return attrs

    # ------------------------------------------------------------------ what a build would do
    def run_register(self, plugin_id: str, inputs: list[TensorDesc], attrs: dict) -> tuple[TensorDesc, ...]:
        plugin = self._registered(plugin_id)
        out = plugin.register(*inputs, **{k: attrs[k] for k in plugin.attrs})
        return out if isinstance(out, tuple) else (out,)

    def run_autotune(self, plugin_id: str, inputs, outputs, attrs: dict) -> list[AutoTuneCombination]:
        plugin = self._registered(plugin_id)
        combos = plugin.autotune(*inputs, *(attrs[a] for a in plugin.autotune_attrs), tuple(outputs))
        for combo in combos:
            if len(combo.io_types) != len(inputs) + len(outputs):
                raise ValueError(
                    f"{plugin_id}: {len(combo.io_types)} types for {len(inputs)} inputs + {len(outputs)} outputs"
                )
        return combos

    def run_aot(self, plugin_id: str, inputs, outputs, attrs: dict, tactic: int = 0):
        plugin = self._registered(plugin_id)
        result = plugin.aot_impl(*inputs, *(attrs[a] for a in plugin.aot_attrs), tuple(outputs), tactic)
        name, ptx, params, extra = result
        if not isinstance(name, (str, bytes)) or not isinstance(ptx, (str, bytes)):
            raise ValueError(f"{plugin_id}: kernel name and PTX must be str or bytes")
        if not isinstance(params, KernelLaunchParams) or not isinstance(extra, SymExprs):
            raise ValueError(f"{plugin_id}: expected (name, ptx, KernelLaunchParams, SymExprs), got {result}")
        return result


def fake_tensorrt() -> tuple[types.ModuleType, types.ModuleType, Qdp]:
    """``(tensorrt, tensorrt.plugin, Qdp)`` modules to put into ``sys.modules``."""
    qdp = Qdp()
    trtp = types.ModuleType("tensorrt.plugin")
    for name in ("register", "autotune", "aot_impl", "from_shape_expr", "cdiv"):
        setattr(trtp, name, getattr(qdp, name))
    for name in (
        "TensorDesc",
        "KernelLaunchParams",
        "SymExprs",
        "SymIntExprs",
        "SymInt32",
        "AutoTuneCombination",
    ):
        setattr(trtp, name, getattr(Qdp, name))
    trt = types.ModuleType("tensorrt")
    trt.float32, trt.float16, trt.bfloat16, trt.int64 = FLOAT32, FLOAT16, BFLOAT16, INT64
    trt.plugin = trtp
    return trt, trtp, qdp
