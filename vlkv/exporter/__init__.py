"""HF checkpoint → ONNX / TensorRT / TensorRT-LLM artifacts, driven by a recipe (``build-engine``).

Modules: ``recipe`` / ``recipe_loader`` (the recipe), ``stages`` (registry + runner), ``manifest``
(skip-if-unchanged), one module per stage (``vision_onnx``, ``decoder_onnx``, ``trt_engine``,
``trtllm_checkpoint``, ``trtllm_engine``) and ``cli``. Nothing is imported here: heavy dependencies
(torch, onnx, tensorrt, tensorrt_llm) load only when a stage runs.
"""
