"""The ``decoder_onnx`` stage: export the single-graph decoder (``decoder_graph``) and check it.

The graph comes from the export cache (``vlkv.runtime.onnx.export_cache``, keyed by the model, the
versions and the code of the graph's modules; checksummed, verified on every read and rebuilt when
damaged), is copied into the stage's folder and checked against the PyTorch module it was traced from,
with ONNX Runtime and Polygraphy (:data:`STAGE_TOLERANCE`).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from torch import nn

from vlkv.exporter import decoder_graph
from vlkv.exporter.decoder_graph import DECODER_FILE, EXPORT_FORMAT, DecoderIO, DecoderStep, example_inputs
from vlkv.exporter.subgraphs import set_subgraph_records
from vlkv.runtime.models.adapter import make_adapter
from vlkv.runtime.onnx import export as onnx_export
from vlkv.runtime.onnx import export_cache, layer_graphs, layer_step, nodes

# Stage check, ONNX Runtime vs PyTorch (atol = rtol) per model dtype. float16 rounds each op at
# 2**-11 relative; through the tiny models' 4 layers the largest difference seen is 1.1e-2 on
# outputs of magnitude ~6 (2-3 float16 ulps), so 5e-2 leaves room for deeper models.
STAGE_TOLERANCE = {"float32": 1e-3, "float16": 5e-2}
_CODE = [Path(m.__file__) for m in (decoder_graph, layer_step, layer_graphs, nodes, onnx_export)]


def export_decoder(model: nn.Module, family: str, path: str | Path, opset: int = 17) -> Path:
    """Export ``model``'s language decoder to ``path`` (see ``decoder_graph``); returns the path."""
    adapter = make_adapter(family, model, getattr(model.config, "image_token_id", 0))
    step = DecoderStep(adapter).eval()
    lay = adapter.layout
    io = DecoderIO(lay.num_layers, lay.pos_dims)
    dtype = next(model.parameters()).dtype
    # distinct past lengths per layer so that no two dynamic axes are traced as equal
    feeds = example_inputs(
        lay, adapter.text_config.hidden_size, dtype, [3 + i for i in range(lay.num_layers)]
    )

    def finish(proto):
        set_subgraph_records(proto, decoder_graph.install_marks(proto, io, step.scale))
        proto.metadata_props.add(key="vlkv.export_format", value=str(EXPORT_FORMAT))
        return proto

    return onnx_export.trace_to_onnx(
        step, feeds, path, io.output_names, io.dynamic_axes(), opset=opset, finish=finish
    )


def decoder_key(model: nn.Module, family: str, opset: int = 17) -> str:
    """The export-cache key of ``model``'s decoder graph (format, family, opset, config, weights, code)."""
    adapter = make_adapter(family, model, getattr(model.config, "image_token_id", 0))
    head = {
        "graph": "decoder",
        "format": EXPORT_FORMAT,
        "family": family,
        "opset": opset,
        "config": adapter.text_config.to_dict(),
    }
    return export_cache.export_key(head, [adapter.layers, adapter.norm, adapter.lm_head], _CODE)


def cached_decoder(model, family: str, cache_dir: str | Path | None = None, opset: int = 17) -> Path:
    """Path of ``model``'s decoder graph in the export cache (``cache_dir`` or ``$VLKV_ONNX_CACHE``),
    verified against its checksums; exported when missing or damaged (said in one line on the
    ``vlkv.exporter`` logger, which ``build-engine`` prints)."""
    return export_cache.cached_export(
        cache_dir,
        decoder_key(model, family, opset),
        DECODER_FILE,
        lambda tmp: export_decoder(model, family, tmp / DECODER_FILE, opset=opset),
        logger=logging.getLogger("vlkv.exporter"),
    )


def export(recipe, out_dir: str | Path) -> Path:
    """The ``decoder_onnx`` stage: ``out_dir/decoder.onnx`` for ``recipe.model`` plus ``metrics.json``.

    The graph comes from the export cache (:func:`cached_decoder`). It is checked against the PyTorch
    module with ONNX Runtime and Polygraphy (:func:`validate`; bfloat16 cannot be fed from numpy and is
    not checked); a mismatch fails the stage.
    """
    from vlkv.exporter.errors import StageError
    from vlkv.exporter.source import load_source_model

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = load_source_model(recipe.model)
    family = recipe.model.family
    cached = cached_decoder(model, family, opset=recipe.decoder.opset)
    for src in cached.parent.iterdir():
        shutil.copy2(src, out_dir / src.name)
    path = out_dir / DECODER_FILE
    adapter = make_adapter(family, model, getattr(model.config, "image_token_id", 0))
    metrics: dict = {
        "layers": adapter.layout.num_layers,
        "export_format": EXPORT_FORMAT,
        "opset": recipe.decoder.opset,
        "cache_entry": cached.parent.name,
    }
    tol = STAGE_TOLERANCE.get(recipe.model.dtype)
    if tol is None:
        metrics["validation"] = f"skipped: numpy / ONNX Runtime on CPU cannot feed {recipe.model.dtype}"
    else:
        result, counts = validate(adapter, path, next(model.parameters()).dtype, tol)
        metrics.update(result.as_metrics())
        metrics["counts_within_bounds"] = counts
        if not (result.passed and result.polygraphy_passed and counts):
            raise StageError(
                f"decoder ONNX differs from PyTorch: max abs err {result.max_abs_err:.3g} (atol {tol})"
                + ("" if counts else "; below/visible counts out of their bounds")
            )
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return path


def validate(adapter, path: Path, dtype: torch.dtype, tol: float):
    """ONNX Runtime + Polygraphy vs the PyTorch module on a prefill (no past) and a decode feed whose
    layers all hold different past lengths.

    Float outputs are compared under ``tol`` (``vlkv.exporter.comparison.compare_onnx``). The integer
    counts are not: ``below`` counts entries under ``threshold × row max``, and an entry within rounding
    of that cut flips between two correct implementations (in float16 it does: one count off by 1).
    So a count must lie between the reference's counts at the threshold moved by ``tol`` either way
    (the count is monotone in the threshold); ``visible`` has no cut and must be equal.

    Returns ``(Comparison of the float outputs, counts within bounds)``.
    """
    import numpy as np

    from vlkv.exporter.comparison import compare_onnx, ort_session

    lay = adapter.layout
    step = DecoderStep(adapter).eval()
    names = DecoderIO(lay.num_layers, lay.pos_dims).output_names
    hidden = adapter.text_config.hidden_size
    cases = [
        example_inputs(lay, hidden, dtype, [0] * lay.num_layers, batch=2, rows=5, seed=1),
        example_inputs(lay, hidden, dtype, [4 + 3 * i for i in range(lay.num_layers)], rows=1, seed=2),
    ]
    session = ort_session(path)
    feeds, floats, counts_ok = [], [], True
    with torch.no_grad():
        for case in cases:
            outs = dict(zip(names, step(*case.values())))
            feed = {k: v.numpy() for k, v in case.items()}
            feeds.append(feed)
            floats.append({n: o.contiguous().numpy() for n, o in outs.items() if o.is_floating_point()})
            got = dict(zip(names, session.run(names, feed)))
            threshold = float(case["stats_threshold"][0])
            low = dict(zip(names, step(*_with_threshold(case, threshold * (1 - tol)).values())))
            high = dict(zip(names, step(*_with_threshold(case, threshold * (1 + tol)).values())))
            for n in names:
                if n.startswith("attn_below"):
                    counts_ok &= bool(np.all((low[n].numpy() <= got[n]) & (got[n] <= high[n].numpy())))
                elif n.startswith("attn_visible"):
                    counts_ok &= bool(np.array_equal(outs[n].numpy(), got[n]))
    return compare_onnx(path, feeds, floats, atol=tol, rtol=tol), counts_ok


def _with_threshold(case: dict, threshold: float) -> dict:
    return {**case, "stats_threshold": torch.tensor([threshold], dtype=torch.float32)}
