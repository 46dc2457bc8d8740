"""``bench_decode_bound.py``'s configuration names and its markdown table.

A *before* row repeats a configuration with one piece as it was (``<config>+torchgemm``,
``<config>+kv4k``, ...): :func:`base_config` names the configuration it repeats and :func:`paired`
orders the rounds so each pair runs back to back.
"""

from __future__ import annotations

import pool_pages

# a before configuration's suffix: the same configuration with one piece as it was
BEFORE = ("+torchevict", "+split", "+torchgemm", "+gemms7", "+gemms8", "+heapdefault", pool_pages.SUFFIX)
# a GEMM-form before's suffix: its set_gemm_form value (0: the current form)
GEMM_FORMS = {"+gemms7": 1, "+gemms8": 2}


def base_config(name: str) -> str:
    """The configuration a before row repeats (its :data:`BEFORE` suffix removed)."""
    for suffix in BEFORE:
        name = name.removesuffix(suffix)
    return name


def paired(configs: list[str]) -> list[str]:
    """``configs`` with each before row right after the configuration it repeats: the rounds rotate
    this order, so a pair runs back to back in every round (on a shared VM the load moves within a
    round; a pair ten configurations apart saw different machines)."""
    out = []
    for name in configs:
        if base_config(name) == name:
            out += [name, *(c for c in configs if c != name and base_config(c) == name)]
    return out + [c for c in configs if c not in out]


def to_markdown(res: dict) -> str:
    lines = [
        f"Decode step vs the bandwidth bound and transformers ({res['model']}, {res['dtype']}, "
        f"{res['machine']}, {res['threads']} threads; {res['prompt_tokens']} tokens ({res.get('layout', 'document-first')}) × batch {res['batch']}, "
        f"median over {res['repeats']} rotating rounds of the mean of {res['steps']} steps)",
        "",
        f"Read bandwidth (sum over {res['buffer_mib']} MiB, best of 7, before and after the rounds: "
        + " / ".join(f"{x:.1f}" for x in res["bandwidth_before_after_gb_s"])
        + f" GB/s; the bound uses {res['bandwidth_gb_s']:.1f}). "
        f"W = {res['weight_bytes'] / 1e9:.3f} GB of weights per step. Bound = (W + KV attended) / bandwidth. "
        f"C++ few-row GEMM: {res.get('cpp_gemm')}. "
        f"Fused decode append: {res.get('fused_append')}. One-call decode eviction: {res.get('fused_evict')}. "
        f"C heap keeps freed memory: {res.get('heap_keeps_freed')}. "
        f"Same tokens (peers vs vlkv full; +kernel vs +halves; +torchgemm vs its C++-GEMM config; +split vs its fused config): {res['peers_same_tokens']}. vlkv/runtime: {res['runtime_lines']} lines.",
        "",
        f"| config | step (ms) | bound (ms) | of bound | vs full | vs {res['fastest_peer'] or 'peer (none run)'} | attention (ms) "
        "| attention of its bound | KV read (MB) | gathered (MB) | aten ops | vs +split | vs +torchevict | vs +gemms7 "
        "| vs +gemms8 | vs +heapdefault | vs +kv4k | attention vs +kv4k | KV in huge pages |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        ratio = r.get("speed_vs_fastest_peer")
        split, evict, s7 = r.get("speed_vs_split"), r.get("speed_vs_torchevict"), r.get("speed_vs_gemms7")
        s8 = r.get("speed_vs_gemms8")
        heap = r.get("speed_vs_heapdefault")
        kv4k, attn4k, share = r.get("speed_vs_kv4k"), r.get("attn_vs_kv4k"), r.get("kv_huge_share")
        lines.append(
            f"| {r['config']} | {r['step_ms']:.1f} | {r['bound_ms']:.1f} | {r['of_bound']:.0%} "
            f"| {r['speed_vs_full']:.2f}× | {'' if ratio is None else f'{ratio:.2f}×'} | {r['attn_ms']:.1f} "
            f"| {r['attn_of_bound']:.0%} | {r['kv_bytes'] / 1e6:.1f} "
            f"| {r['gathered_bytes'] / 1e6:.1f} | {r['ops_per_step']} | {'' if split is None else f'{split:.2f}×'} "
            f"| {'' if evict is None else f'{evict:.2f}×'} | {'' if s7 is None else f'{s7:.2f}×'} "
            f"| {'' if s8 is None else f'{s8:.2f}×'} "
            f"| {'' if heap is None else f'{heap:.2f}×'} "
            f"| {'' if kv4k is None else f'{kv4k:.2f}×'} | {'' if attn4k is None else f'{attn4k:.2f}×'} "
            f"| {'' if share is None else f'{share:.0%}'} |"
        )
    return "\n".join(lines) + "\n"
