"""``report.md`` of a ``gpu_check.py`` run: the parts, the targets, then one table per measurement."""

from __future__ import annotations


def _fmt(x, spec: str = ".2f") -> str:
    return format(x, spec) if isinstance(x, int | float) else str(x)


def _env(res: dict) -> list[str]:
    gpu = res.get("gpu") or {}
    bw = res.get("bandwidth") or {}
    lines = [
        f"- device: {gpu.get('name', res.get('cpu', '?'))} (capability {gpu.get('capability', '-')}, "
        f"{gpu.get('multiprocessors', '-')} SMs, {gpu.get('memory_gib', '-')} GiB); nvidia-smi: "
        f"{res.get('nvidia_smi', '-')}",
        f"- python {res.get('python')}, torch {res.get('torch')} (CUDA {res.get('cuda_runtime')}), "
        + ", ".join(f"{k} {v or 'absent'}" for k, v in (res.get("versions") or {}).items()),
    ]
    if bw:
        lines.append(
            f"- memory bandwidth: copy {bw['copy_gbps']:.0f} GB/s (read + write), read-only sum "
            f"{bw['read_gbps']:.0f} GB/s, over a {bw['buffer_bytes'] / 2**30:.2f} GiB buffer"
        )
    return lines


def _kernels(res: dict) -> list[str]:
    lines = [f"Path: {res.get('path')}, {res.get('dtype')}, sizes {res.get('sizes')}", ""]
    stats = res.get("stats")
    if isinstance(stats, list):
        lines += [
            "| keys | statistics (ms) | SDPA same rows (ms) | ratio | colsum max err |",
            "|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['keys']} | {r['stats_ms']:.3f} | {r['sdpa_ms']:.3f} | {r['ratio']:.2f} | {r['colsum_max_err']:.2e} |"
            for r in stats
        ]
    else:
        lines.append(f"statistics: {stats}")
    sel = res.get("selected")
    if isinstance(sel, dict):
        lines += ["", "| selected of keys | selected (ms) | gather + SDPA (ms) | full SDPA (ms) | speed-up vs gather | max err |",
                  "|---|---:|---:|---:|---:|---:|",
                  f"| {sel['selected']} of {sel['keys']} | {sel['selected_ms']:.3f} | {sel['gather_sdpa_ms']:.3f} "
                  f"| {sel['full_sdpa_ms']:.3f} | {sel['speedup_vs_gather']:.2f}× | {sel['max_err']:.2e} |"]  # fmt: skip
    else:
        lines.append(f"selected attention: {sel}")
    paged = res.get("paged")
    if isinstance(paged, list):
        lines += ["", "| paged read: tokens × batch | paged (ms) | SDPA contiguous (ms) | ratio | GB/s | max err |",
                  "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        lines += [
            f"| {r['tokens']} × {r['batch']} | {r['paged_ms']:.3f} | {r['contiguous_sdpa_ms']:.3f} "
            f"| {r['ratio_vs_sdpa']:.2f} | {r['paged_gbps']:.0f} | {r['max_err_vs_sdpa']:.2e} |"
            for r in paged
        ]
    else:
        lines.append(f"paged read: {paged}")
    for name in ("lowrank", "merge"):
        r = res.get(name)
        lines.append("")
        lines.append(
            f"{name}: "
            + (", ".join(f"{k} {_fmt(v, '.4g')}" for k, v in r.items()) if isinstance(r, dict) else str(r))
        )
    return lines + _paged_probs(res) + _lowrank_split(res)


def _lowrank_split(res: dict) -> list[str]:
    """The kernels part's ``lowrank_split`` rows (``gpu_lowrank_split``) as a table; [] without them."""
    if "lowrank_split" not in res:
        return []
    from gpu_lowrank_split import markdown  # scripts/ is on sys.path where reports are written

    return markdown(res["lowrank_split"])


def _paged_probs(res: dict) -> list[str]:
    """The kernels part's ``paged_probs`` rows (``gpu_kernels.kernel_paged_probs``) as a table; [] where
    the part has no such entry."""
    probs = res.get("paged_probs")
    if not isinstance(probs, list):
        return [] if probs is None else ["", f"paged read with probabilities: {probs}"]
    lines = ["", "| paged read with probabilities: tokens × batch | kernel (ms) | two halves (ms) | plain paged (ms) "
             "| SDPA contiguous (ms) | speed-up vs halves | ratio vs paged | probs / out max err |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    lines += [
        f"| {r['tokens']} × {r['batch']} | {_fmt(r.get('probs_ms'), '.3f')} | {r['halves_ms']:.3f} | {r['paged_ms']:.3f} "
        f"| {r['contiguous_sdpa_ms']:.3f} | {_fmt(r.get('speedup_vs_halves'))} | {_fmt(r.get('ratio_vs_paged'))} "
        f"| {_fmt(r.get('probs_max_err'), '.1e')} / {_fmt(r.get('out_max_err'), '.1e')} |"
        for r in probs
    ]
    return lines


def _decode(res: dict) -> list[str]:
    lines = [
        f"{res.get('dtype')}; bandwidth for the bound: {_fmt(res.get('bandwidth_gbps'), '.0f')} GB/s (copy). "
        "bound = (weight bytes + K/V bytes attended) / bandwidth; of bound = bound / measured step.",
        "",
        "| model | context × batch | policy | budget | step (ms) | full step (ms) | speed-up | limit | of bound | full of bound |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for c in res.get("cells", []):
        where = f"{c['model'].removeprefix('shape:')} | {c['tokens']} × {c['batch']}"
        if "status" in c:
            notes.append(f"- {where.replace(' |', ',')}: {c['status']}")
            continue
        for r in c.get("rows", []):
            lines.append(
                f"| {where} | {r['policy']} | {r['budget']} | {r['step_ms']:.2f} | {r['full_step_ms']:.2f} "
                f"| {r['speedup']:.2f}× | {r['limit']:.2f}× | {r['of_bound']:.0%} | {r['full_of_bound']:.0%} |"
            )
        for pol, why in c.get("errors", {}).items():
            notes.append(f"- {where.replace(' |', ',')}, {pol}: {why}")
    return lines + ([""] + notes if notes else [])


def _prefill(res: dict) -> list[str]:
    rows = res.get("rows") or []
    lines = [f"{res.get('tokens')} tokens, {res.get('dtype')}, {res.get('machine')}", "",
             "| configuration | rows with statistics | prefill (s) | overhead |", "|---|---:|---:|---:|"]  # fmt: skip
    lines += [
        f"| {r['config']} | {r['rows_requested']} | {r['median_s']:.4f} | {r['overhead']:+.1%} |"
        for r in rows
    ]
    for name, b in (res.get("breakdown") or {}).items():
        top = "; ".join(f"{o['op'][:60]} {o['ms']:.2f} ms × {o['calls']}" for o in b.get("top", [])[:8])
        lines += ["", f"- {name}, profiled once ({b.get('ops')} operator events), own time: {top}"]
    return lines


def _pytest(res: dict) -> list[str]:
    lines = [f"`{res.get('command')}` → exit {res.get('exit_code')}, {res.get('counts')}", ""]
    if res.get("errors"):  # each failure's own lines (the tail may hold only the last one's end)
        lines += ["Failures:", "", "```text", *res["errors"].splitlines()[:80], "```", ""]
    return lines + ["```text", *(res.get("tail") or "").strip().splitlines()[-25:], "```"]


def _profile(res: dict) -> list[str]:
    lines = [f"{res.get('model', '').removeprefix('shape:')}, {res.get('tokens')} tokens × batch {res.get('batch')}, budget 0.2; "
             "`engine`: Engine.decode on one batched cache; `scheduler`: Scheduler.step() (the step plan, what serve runs)", "",
             "| policy | path | step (ms) | step (ms, profiled) | ops / step | host syncs / step | copies / step | top ops by self CPU (ms / step) |",
             "|---|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    host = ["", "Host Python per step (cProfile, no operator profiler): Triton's launcher (ms / launches) and the functions "
            "with the most own time (ms / step)", "", "| policy | path | step (ms, cProfile) | Triton launch | top own time |",
            "|---|---|---:|---|---|"]  # fmt: skip
    for name, row in (res.get("policies") or {}).items():
        paths = row if isinstance(row, dict) and "step_ms_profiled" not in row else {"engine": row}
        for path, p in paths.items():
            if not isinstance(p, dict):
                lines.append(f"| {name} | {path} | {p} | | | | | |")
                continue
            top = "; ".join(f"{o['op']} {o['self_cpu_ms_per_step']:.1f}" for o in p["top_self_cpu"][:5])
            dev = "; ".join(
                f"{o['op'][:40]} {o['device_ms_per_step']:.2f}" for o in p.get("top_device", [])[:4]
            )
            top += f" — device: {dev}" if dev else ""
            lines.append(
                f"| {name} | {path} | {p.get('step_ms', float('nan')):.1f} | {p['step_ms_profiled']:.1f} "
                f"| {p['ops_per_step']:.0f} | {p['syncs_per_step']:.0f} | {p['copies_per_step']:.0f} | {top} |"
            )
            h = p.get("host")
            if h:
                own = "; ".join(f"{o['fn']} {o['own_ms_per_step']:.2f}" for o in h["top_own"][:6])
                host.append(
                    f"| {name} | {path} | {h['step_ms_cprofile']:.1f} "
                    f"| {h['triton_launch_ms_per_step']:.2f} / {h['triton_launches_per_step']:.0f} | {own} |"
                )
    return lines + (host if len(host) > 5 else [])


def _compile(res: dict) -> list[str]:
    from gpu_graph import markdown  # scripts/ is on sys.path where reports are written

    return markdown(res)


SECTIONS = {
    "env": _env,
    "kernels": _kernels,
    "decode": _decode,
    "prefill": _prefill,
    "pytest": _pytest,
    "profile": _profile,
    "compile": _compile,
}


def to_markdown(report: dict) -> str:
    env = report["parts"].get("env", {}).get("result", {})
    device = (env.get("gpu") or {}).get("name") or env.get("cpu") or report["device"]
    lines = [
        f"# vlkv GPU check — {device}",
        "",
        f"Started {report['started']}, {report['wall_s']:.0f} s in all"
        + (" (toy sizes: the CPU dry run)" if report.get("tiny") else "")
        + ".",
        "",
        "| part | status | wall (s) | limit (s) | reason |",
        "|---|---|---:|---:|---|",
    ]
    for name, p in report["parts"].items():
        lines.append(
            f"| {name} | {p['status']} | {p['wall_s']:.1f} | {p['budget_s']:.0f} | {p['reason'] or ''} |"
        )
    lines += ["", "## Targets", "", "| measure | value | target | met |", "|---|---:|---|---|"]
    for t in report["targets"]:
        met = "—" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['name']} | {_fmt(t['value'], '.3g')} | {t['target']} | {met} |")
    for name, part in report["parts"].items():
        if name in SECTIONS and part["result"] and "skipped" not in part["result"]:
            lines += ["", f"## {name}", "", *SECTIONS[name](part["result"])]
    return "\n".join(lines) + "\n"
