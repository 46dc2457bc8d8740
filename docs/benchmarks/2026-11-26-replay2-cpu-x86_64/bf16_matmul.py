"""bf16 vs fp32 matrix product at 1 thread, CPU time: does this CPU run bf16 natively?

    python docs/benchmarks/2026-11-26-replay2-cpu-x86_64/bf16_matmul.py
    ONEDNN_MAX_CPU_ISA=AVX512_CORE python ...   # oneDNN held below avx512_bf16: an AVX-512 CPU without it
    ONEDNN_MAX_CPU_ISA=AVX2 python ...          # an AVX2-only CPU

The product is a replay layer's projection: 1024 rows x 576 (SmolLM2-135M's width) x 1536 (its MLP).
"""

import time

import torch

torch.set_num_threads(1)
a, b = torch.randn(1024, 576), torch.randn(576, 1536)


def cpu_ms(x, y, n=20):
    x @ y  # warm-up
    t0 = time.process_time()
    for _ in range(n):
        x @ y
    return (time.process_time() - t0) / n * 1e3


f, h = cpu_ms(a, b), cpu_ms(a.bfloat16(), b.bfloat16())
print(f"fp32 {f:.1f} ms, bf16 {h:.1f} ms: bf16 takes {h / f:.2f}x the fp32 time")
