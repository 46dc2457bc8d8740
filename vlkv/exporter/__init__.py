"""HF checkpoint → ONNX / TensorRT / TensorRT-LLM artifacts, driven by a recipe (``build-engine``).

Modules:

- the recipe: ``recipe`` (nested dataclasses), ``recipe_loader`` (YAML + ``--set`` overrides);
- running it: ``stages`` (registry + runner), ``manifest`` (skip-if-unchanged), ``build_lock`` (one
  build per ``--out``), ``errors`` (``StageError`` / ``StageSkipped``), ``cli``;
- one module per stage: ``vision_onnx``, ``decoder_onnx``, ``graph_rewrite`` (``plugin_graph``),
  ``trt_engine``, ``trtllm_checkpoint``, ``trtllm_engine``;
- what the stages share: ``source`` (loads the HF model), ``vision_tower`` (export-friendly vision
  encoders), ``decoder_graph`` (the single-graph decoder and its I/O contract), ``subgraphs`` (the
  plugin-replaceable subgraph records), ``comparison`` (ONNX Runtime / Polygraphy checks),
  ``trt_profiles`` (optimisation-profile shapes), ``export_cache`` (the stage's view of the runtime's
  checksummed ONNX export cache, ``vlkv.runtime.onnx.export_cache``).

The exporter builds on the runtime (models, per-layer modules, the export cache), never the other way
round. Nothing is imported here: heavy dependencies (torch, onnx, tensorrt, tensorrt_llm) load only
when a stage runs.
"""
