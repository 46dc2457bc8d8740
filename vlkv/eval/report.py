"""Benchmark report writer: a markdown table, the raw records and plots in one dated folder.

A record is a flat dict, one per (policy, budget, setting) measurement, for example::

    {"policy": "h2o", "budget": 0.2, "machine": "cpu-2core", "context_length": 1024,
     "ppl": 13.1, "rouge_l": 0.71, "decode_speed_ratio": 1.4}

``policy``, ``budget`` (kept fraction in ``(0, 1]``) and ``machine`` are required. Numeric
keys ending in ``_ratio`` are speed ratios (compressed / full; plotted against
``context_length``); other numeric keys that are not axes or timings are quality metrics
(plotted against ``budget``). Plots use matplotlib's Agg canvas directly, so no display and
no global backend switch is needed.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["AXIS_KEYS", "REQUIRED_KEYS", "Report", "markdown_table", "write_report"]

REQUIRED_KEYS = ("policy", "budget", "machine")
# Numeric keys that describe the setting rather than measure it.
AXIS_KEYS = frozenset(
    {"budget", "context_length", "batch", "batch_size", "max_new_tokens", "seed", "num_samples"}
)


@dataclass(frozen=True)
class Report:
    """What :func:`write_report` wrote.

    Attributes:
        out_dir: ``<root>/<date>-<machine>/`` for the day's first run on that machine, then
            ``<root>/<date>-<machine>-r2/``, ``-r3/`` …: a report never overwrites another run's.
        table: ``results.md`` (markdown table plus a short header).
        records: ``results.json`` (the input records verbatim, for re-plotting).
        plots: one PNG per quality metric (``quality-<metric>.png``) and per speed ratio
            (``speed-<ratio>.png``), in that order.
    """

    out_dir: Path
    table: Path
    records: Path
    plots: tuple[Path, ...] = field(default_factory=tuple)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _validate(records: Sequence[dict]) -> None:
    if not records:
        raise ValueError("records must be a non-empty list of dicts")
    for i, rec in enumerate(records):
        missing = [k for k in REQUIRED_KEYS if k not in rec]
        if missing:
            raise ValueError(f"records[{i}] lacks required key(s) {missing}; required: {list(REQUIRED_KEYS)}")
        if not _is_number(rec["budget"]) or not 0 < rec["budget"] <= 1:
            raise ValueError(f"records[{i}]['budget'] must be a number in (0, 1], got {rec['budget']!r}")


def _numeric_keys(records: Iterable[dict]) -> list[str]:
    keys: dict[str, None] = {}
    for rec in records:
        for k, v in rec.items():
            if _is_number(v) and k not in AXIS_KEYS:
                keys[k] = None
    return list(keys)


def _speed_keys(records: Sequence[dict]) -> list[str]:
    speed = [r for r in records if r.get("kind", "speed") == "speed"]
    return [k for k in _numeric_keys(speed) if k.endswith("_ratio")]


def _quality_keys(records: Sequence[dict]) -> list[str]:
    # Raw timings ("*_s", "*_ms"), throughputs and sizes are machine facts, not quality; they stay
    # in the table but get no quality-vs-budget plot.
    skip = ("_ratio", "_s", "_ms", "_tok_per_s", "tokens_per_s", "_bytes", "_mib")
    quality = [r for r in records if r.get("kind", "quality") == "quality"]
    # full_* columns are the shared baseline, constant across budgets: a table column, not a plot
    return [k for k in _numeric_keys(quality) if not k.endswith(skip) and not k.startswith("full_")]


def _fmt(value: object) -> str:
    if _is_number(value):
        if isinstance(value, int):
            return str(value)
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value).replace("|", "\\|")


def markdown_table(records: Sequence[dict]) -> str:
    """A GitHub markdown table: identity columns first, then metrics in first-seen order.

    Rows are sorted by policy, then budget, then context length. Missing cells are blank.
    """
    _validate(records)
    columns: dict[str, None] = dict.fromkeys(["policy", "budget"])
    if any("context_length" in r for r in records):
        columns["context_length"] = None
    for rec in records:
        columns.update(dict.fromkeys(k for k in rec if k != "machine"))
    cols = list(columns)
    rows = sorted(records, key=lambda r: (str(r["policy"]), r["budget"], r.get("context_length", 0)))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r[c]) if c in r else "" for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _mean_by(records: Sequence[dict], group: str, x: str, y: str) -> dict[str, tuple[list, list]]:
    """{group value: (sorted xs, mean y at each x)} over records that have x and y."""
    acc: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for rec in records:
        if x in rec and _is_number(rec.get(y)):
            acc[str(rec[group]) if group in rec else ""][rec[x]].append(float(rec[y]))
    return {g: (sorted(d), [sum(d[k]) / len(d[k]) for k in sorted(d)]) for g, d in sorted(acc.items())}


def _plot(series: dict[str, tuple[list, list]], xlabel: str, ylabel: str, title: str, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    return path


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "unknown"


RESULTS = "results.json"
PLOT_GLOBS = ("quality-*.png", "speed-*.png")


def claim_run_dir(root: str | Path, stem: str) -> Path:
    """The first of ``<root>/<stem>``, ``<stem>-r2``, ``<stem>-r3`` … that holds no report yet,
    claimed atomically by creating its ``results.json`` (two concurrent runs get two folders)."""
    for k in range(1, 10_000):
        out_dir = Path(root) / (stem if k == 1 else f"{stem}-r{k}")
        out_dir.mkdir(parents=True, exist_ok=True)
        try:
            with open(out_dir / RESULTS, "x") as f:
                f.write("[]\n")
            return out_dir
        except FileExistsError:
            continue
    raise RuntimeError(f"no free report folder for {stem!r} under {root}")


def write_report(
    records: Sequence[dict],
    root: str | Path = "docs/benchmarks",
    date: str | None = None,
    machine: str | None = None,
    title: str = "vlkv benchmark",
    into: str | Path | None = None,
) -> Report:
    """Write ``results.md``, ``results.json`` and PNG plots into a new run folder
    ``<root>/<date>-<machine>[-rN]/`` (see :class:`Report`); earlier runs are never touched.

    Args:
        records: result dicts (see module docstring); all must name the same ``machine`` unless
            ``machine`` is given, because one folder holds one machine's numbers.
        root: parent folder, ``docs/benchmarks`` by default.
        date: ``YYYY-MM-DD``; today (local time) when None.
        machine: folder label overriding the records' machine.
        title: first line of ``results.md``.
        into: rewrite this run's own folder (a previous :class:`Report`'s ``out_dir``) with a
            superset of its records, e.g. after the peers ran; plots no longer produced are removed
            so the folder's plots always match its records.
    """
    _validate(records)
    machines = sorted({str(r["machine"]) for r in records})
    if machine is None:
        if len(machines) != 1:
            raise ValueError(f"records name several machines {machines}; pass machine= or split them")
        machine = machines[0]
    date = date or _dt.date.today().isoformat()
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", date):
        raise ValueError(f"date must be YYYY-MM-DD, got {date!r}")
    if into is None:
        out_dir = claim_run_dir(root, f"{date}-{_slug(machine)}")
    else:
        out_dir = Path(into)
        previous = json.loads((out_dir / RESULTS).read_text()) if (out_dir / RESULTS).is_file() else []
        if len(previous) > len(records):
            raise ValueError(
                f"{out_dir} holds {len(previous)} records, more than the {len(records)} given: "
                "into= only rewrites a run with a superset of its records"
            )

    table = out_dir / "results.md"
    header = f"# {title}\n\nMachine(s): {', '.join(machines)}. Date: {date}. Records: {len(records)}.\n\n"
    kinds = sorted({str(r["kind"]) for r in records if "kind" in r})
    if len(kinds) > 1:  # one table per kind of measurement keeps the columns meaningful
        body = "".join(
            f"## {kind}\n\n" + markdown_table([r for r in records if r.get("kind") == kind]) + "\n"
            for kind in kinds
        )
    else:
        body = markdown_table(records)
    table.write_text(header + body)
    raw = out_dir / "results.json"
    raw.write_text(json.dumps(list(records), indent=2, default=str) + "\n")

    plots = []
    for key in _quality_keys(records):
        series = _mean_by(records, "policy", "budget", key)
        if series:
            path = out_dir / f"quality-{_slug(key)}.png"
            plots.append(_plot(series, "budget (kept fraction)", key, f"{key} vs budget", path))
    for key in _speed_keys(records):
        with_ctx = [
            {**r, "label": f"{r['policy']}@{r['budget']:g}"} for r in records if "context_length" in r
        ]
        series = _mean_by(with_ctx, "label", "context_length", key)
        if series:
            path = out_dir / f"speed-{_slug(key)}.png"
            plots.append(_plot(series, "context length (tokens)", key, f"{key} vs context length", path))
    for stale in {p for g in PLOT_GLOBS for p in out_dir.glob(g)} - set(plots):
        stale.unlink()
    return Report(out_dir=out_dir, table=table, records=raw, plots=tuple(plots))
