"""``--device`` / ``--dtype`` for every benchmark script, and the machine name its report quotes, the
CPU's name and its read bandwidth.

A script adds the flags with :func:`add_device_args` and calls :func:`check_device_args` right after
parsing: ``--device cuda`` on a machine without CUDA ends the script with one line (exit 2).
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# the long names some scripts already accepted
DTYPES.update(float32=torch.float32, bfloat16=torch.bfloat16, float16=torch.float16)


def add_device_args(ap: argparse.ArgumentParser, dtype: str = "fp32") -> None:
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--dtype", default=dtype, choices=sorted(DTYPES), help="model / tensor dtype")


def check_device_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Resolve ``args.device`` to a name that exists here, or ``ap.error`` with one line; apply
    ``args.threads`` where the script has it."""
    from vlkv.runtime.device import resolve_device

    try:
        args.device = str(resolve_device(args.device))
    except ValueError as exc:
        ap.error(str(exc))
    threads = getattr(args, "threads", 0)
    if threads < 0:
        ap.error(f"--threads must be >= 0, got {threads}")
    if threads:
        torch.set_num_threads(threads)


def add_threads_arg(ap: argparse.ArgumentParser) -> None:
    # on a CPU shared with other jobs, 1 thread avoids OpenMP barrier stalls that swamp the ratios
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")


def add_shape_args(ap: argparse.ArgumentParser, tokens: int, steps: int, tiny_help: str) -> None:
    """``--tiny``, ``--model``, ``--tokens``, ``--batch``, ``--steps``, ``--repeats`` of a decode benchmark."""
    ap.add_argument("--tiny", action="store_true", help=tiny_help)
    ap.add_argument("--model", default="smollm2-llava")
    ap.add_argument("--tokens", type=int, default=tokens)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=steps, help="timed decode steps per configuration and round")
    ap.add_argument("--repeats", type=int, default=3, help="rounds (each runs every configuration)")


def apply_tiny(ap: argparse.ArgumentParser, args: argparse.Namespace, tiny: dict) -> None:
    """``--tiny``: the values in ``tiny`` for every setting left at its default (a flag given wins)."""
    if args.tiny:
        for key, value in tiny.items():
            if ap.get_default(key) == getattr(args, key):
                setattr(args, key, value)


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


def load_for_bench(model: str, device: str, dtype: str):
    """The registered model on ``device`` in ``dtype``; a load failure is one line (exit 2).

    ``shape:NAME`` is a random-weight model at a real checkpoint's shape
    (``vlkv.runtime.models.real_shape.SHAPES``, e.g. ``shape:llava-1.5-7b``): speed only, no text.
    """
    from vlkv.runtime.models.registry import ModelLoadError, load_model

    if model.startswith("shape:"):
        from vlkv.runtime.models.real_shape import load_real_shape

        try:
            return load_real_shape(model.removeprefix("shape:"), device=device, dtype=torch_dtype(dtype))
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None

    try:
        return load_model(model, dtype=torch_dtype(dtype), device=device)
    except ModelLoadError as exc:
        raise SystemExit(f"error: {exc}") from None


def sync(device: str) -> None:
    """Wait for queued kernels so a wall-clock timer measures them."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def write_report(md: str, res: dict, args: argparse.Namespace) -> None:
    """Print a benchmark's markdown, and write it and its JSON where ``--md`` / ``--json`` say."""
    import json
    from pathlib import Path

    print(md)
    if getattr(args, "json", None):
        Path(args.json).write_text(json.dumps(res, indent=2))
    if getattr(args, "md", None):
        Path(args.md).write_text(md)


def machine_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    cpu = platform.processor() or platform.machine()
    return f"{torch.get_num_threads()}-thread {cpu} CPU, no GPU"


# where the image sits in :func:`document_prompt`'s prompt
LAYOUTS = ("document-first", "image-first")


def document_prompt(engine, model: str, tokens: int, layout: str = "document-first"):
    """A document, an image, then a question: about ``tokens`` tokens (the text scaled in a few passes).

    ``document-first`` (the default): the image sits near the end, as in "read this, look at that,
    answer": VL-Cache's post-vision rows are then the question's rows, the window its method describes.
    A-VL keeps every entry before the first image whatever its budget (its "system" region), so there
    it compresses only the image and the question. ``image-first``: the image, then the document and
    the question: A-VL's text budget (H2O over the text after the image) then covers the document.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    from vlkv.eval.corpus import paragraphs
    from vlkv.runtime.models.photos import real_photos
    from vlkv.runtime.prompt import Prompt

    image = real_photos()[0] if model == "smollm2-llava" else "builtin:gradient"
    corpus = " ".join(paragraphs()).split()
    corpus = corpus * (2 * tokens // len(corpus) + 1)  # long contexts repeat the corpus
    words = max(tokens // 2, 1)
    for _ in range(4):
        text = " ".join(corpus[:words])
        if layout == "document-first":
            body = f"{text}\n{engine.placeholder}\nSummarise the text above and describe the image."
        else:
            body = f"{engine.placeholder}\n{text}\nSummarise the text above and describe the image."
        prompt = Prompt(body, [image], raw=True)
        batch = engine.encode([prompt])
        n = int(batch.lengths[0])
        if abs(n - tokens) <= 16:
            break
        words = max(1, round(words * tokens / n))
    return batch


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the platform's."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def read_bandwidth(mib: int, repeats: int = 7) -> float:
    """Bytes/s of the best ``sum`` over a ``mib`` MiB float32 buffer (torch's threads)."""
    x = torch.ones(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best
