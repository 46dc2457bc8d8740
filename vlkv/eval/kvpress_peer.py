"""Run NVIDIA kvpress as a peer baseline, in its own virtualenv, through JSON files.

kvpress pins ``transformers<5.3`` and vlkv needs 5.x, so kvpress lives in ``.venvs/kvpress``
(built by ``python scripts/kvpress_env.py``) and ``scripts/kvpress_adapter.py`` runs there
as a subprocess. This module is the vlkv side: it validates jobs, launches the adapter and
reads the results back. Nothing here imports kvpress.

Images: kvpress only hooks the language model's attention layers, so a VLM prompt is passed
as ``inputs_embeds`` ``(n, hidden)`` with the projected image features already spliced in at
the image-token rows, saved with ``torch.save``; the model dir holds the VLM's language model
saved on its own as a ``*ForCausalLM``.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = [
    "KVPRESS_NAMES",
    "KvpressJob",
    "KvpressUnavailable",
    "kvpress_python",
    "run_kvpress",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
ADAPTER = REPO_ROOT / "scripts" / "kvpress_adapter.py"
STAMP_NAME = "vlkv-kvpress-stamp.json"  # written by scripts/kvpress_env.py once `import kvpress` works
# Mirrors the adapter's PRESSES table; the adapter stays the authority on what kvpress builds.
KVPRESS_NAMES = (
    "none",
    "streaming_llm",
    "snapkv",
    "observed_attention",
    "pyramidkv",
    "knorm",
    "expected_attention",
    "tova",
    "random",
    "merging",
    "kvzip",
    "kvgrad",
)
MODES = ("greedy", "logits", "timing")


class KvpressUnavailable(RuntimeError):
    """The kvpress venv is missing; the message says how to create it."""


@dataclass
class KvpressJob:
    """One adapter job; see ``scripts/kvpress_adapter.py`` for field semantics.

    Attributes:
        model_dir: saved Llama-family ``*ForCausalLM`` directory.
        press: one of :data:`KVPRESS_NAMES`.
        budget: kept fraction of the prompt in ``(0, 1]``; kvpress gets ``1 - budget``.
        keep_rounding: ``"vlkv"`` makes kvpress keep round(n·budget) entries like vlkv;
            ``"kvpress"`` passes ``1 - budget`` as is (kvpress floors).
        input_ids: prompt ids, length n; or
        inputs_embeds_path: ``.pt`` of a float ``(n, hidden)`` tensor (exactly one of the two).
        continuation_ids: teacher-forced ids for ``mode="logits"``, length T (logits ``(T, V)``).
        reference_logits_path: ``.pt`` of the full cache's ``(T, V)`` logits over the same
            continuation: the result adds per-token KL and top-1 agreement against them.
        clock: ``mode="timing"``: ``"wall"`` or ``"cpu"`` (the adapter process's CPU time).
    """

    model_dir: str
    press: str = "none"
    budget: float = 1.0
    mode: str = "greedy"
    keep_rounding: str = "vlkv"
    input_ids: list[int] | None = None
    inputs_embeds_path: str | None = None
    question_ids: list[int] | None = None
    press_kwargs: dict = field(default_factory=dict)
    max_new_tokens: int = 16
    stop_on_eos: bool = False
    continuation_ids: list[int] | None = None
    top_k: int = 5
    logits_path: str | None = None
    reference_logits_path: str | None = None
    kept_indices_path: str | None = None
    attn_implementation: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    warmup: int = 1
    repeats: int = 3
    threads: int | None = None
    clock: str = "wall"
    id: str | None = None

    def __post_init__(self):
        if self.press not in KVPRESS_NAMES:
            raise ValueError(f"press must be one of {KVPRESS_NAMES}, got {self.press!r}")
        if not 0 < self.budget <= 1:
            raise ValueError(f"budget must be in (0, 1], got {self.budget}")
        if self.keep_rounding not in ("vlkv", "kvpress"):
            raise ValueError(f"keep_rounding must be 'vlkv' or 'kvpress', got {self.keep_rounding!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.clock not in ("wall", "cpu"):
            raise ValueError(f"clock must be 'wall' or 'cpu', got {self.clock!r}")
        if (self.input_ids is None) == (self.inputs_embeds_path is None):
            raise ValueError("exactly one of input_ids and inputs_embeds_path must be set")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.mode == "logits" and not self.continuation_ids:
            raise ValueError("continuation_ids must be non-empty when mode='logits'")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {self.repeats}, {self.warmup}")

    def to_json(self) -> dict:
        """The job as the adapter reads it (None-valued optional fields dropped)."""
        return {k: v for k, v in asdict(self).items() if v is not None}


def kvpress_python(venv: str | Path | None = None) -> Path | None:
    """The kvpress venv's interpreter if the venv was built and verified, else None.

    Looks at ``venv``, then ``$VLKV_KVPRESS_VENV``, then ``<repo>/.venvs/kvpress``. Checks the
    stamp file only (cheap), not ``import kvpress`` (about 20 s).
    """
    candidates = [venv, os.environ.get("VLKV_KVPRESS_VENV"), REPO_ROOT / ".venvs" / "kvpress"]
    for cand in candidates:
        if cand and (Path(cand) / STAMP_NAME).is_file() and (Path(cand) / "bin" / "python").exists():
            return Path(cand) / "bin" / "python"
    return None


def run_kvpress(
    jobs: list[KvpressJob],
    python: str | Path | None = None,
    timeout: float = 1800,
    work_dir: str | Path | None = None,
) -> list[dict]:
    """Run ``jobs`` in one adapter process (kvpress is imported, and each model loaded, once).

    Returns one result dict per job, in order; failed jobs have ``ok=False`` and ``error``.
    Raises :class:`KvpressUnavailable` when no venv is found, and ``RuntimeError`` with the
    adapter's last stderr line if the process itself fails or times out.
    """
    py = Path(python) if python else kvpress_python()
    if py is None:
        raise KvpressUnavailable("kvpress venv not found; create it with `python scripts/kvpress_env.py`")
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        jobs_path, results_path = Path(tmp) / "jobs.json", Path(tmp) / "results.json"
        jobs_path.write_text(json.dumps([j.to_json() for j in jobs]))
        try:
            proc = subprocess.run(
                [str(py), str(ADAPTER), str(jobs_path), str(results_path)],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"kvpress adapter timed out after {timeout} s") from exc
        if not results_path.exists():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"kvpress adapter failed (rc={proc.returncode}): {last}")
        return json.loads(results_path.read_text())
