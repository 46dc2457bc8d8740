"""The language decoder as ONNX graphs the runtime runs, and the export cache they live in.

The runtime owns these graphs; ``vlkv.exporter`` builds its single-graph decoder from the same
modules, so the dependency runs one way (exporter → runtime, never back). Nothing is imported here.

- ``nodes``: one-node ``Reshape`` / ``Expand`` for tracing (keeps the graphs small);
- ``layer_step``: one decoder layer on explicit K/V; attention scores are computed once and feed
  both the output and the statistics (``colsum / below / visible``);
- ``layer_graphs``: one ONNX graph per decoder layer plus a head graph (norm + LM head), what the
  ONNX Runtime backend runs layer by layer so it can gather K/V and drop rows between layers;
- ``export``: the TorchScript export + save (external data above 1 GiB) shared by every graph;
- ``export_cache``: content-keyed directories under ``$VLKV_ONNX_CACHE``, published by atomic rename,
  checksummed (size + sha256, verified on every read, rebuilt when damaged), with locked temporary
  folders that are removed once their writer is gone. The exporter's decoder graph uses it too.
"""
