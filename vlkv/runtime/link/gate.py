"""The correctness gate: measure linked-vs-full fidelity per model and link method, refuse bad linking.

``vlkv link-check --model M`` runs built-in probes: each probe first computes its images (as a
request that becomes their records), then asks a *different* prompt about the same images — other
text, other order — once with full recompute and once linked. Over ``tokens`` teacher-forced steps
(the full recompute's own greedy continuation) it records top-1 agreement and the mean KL(full ‖
linked) of the next-token distributions. The result is saved beside the model (keyed by the model
fingerprint, method and k); a linking request whose measured agreement is below the threshold is
refused with one line saying why, and recomputes instead.

Linking is *default-deny*: a model and method with no saved check are refused the same way (a model
never measured could answer wrongly from linked K/V, and nothing would say so). An operator who
accepts that opts in explicitly: a threshold of 0 (``--link-threshold 0``: any agreement, measured
or not) or ``VLKV_LINK_UNCHECKED=1`` in the environment (``vlkv serve``, which has no threshold flag).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from vlkv.runtime.link.linker import link_prefill
from vlkv.runtime.link.segment_store import SegmentStore
from vlkv.runtime.link.spec import LinkSpec, link_label
from vlkv.runtime.prompt import Prompt

# (first prompt, later prompt, images): the later prompt reuses the first one's images elsewhere
PROBES = (
    ("Describe this picture.", "Before anything else: which colours dominate here?", ["builtin:gradient"]),
    (
        "Compare the two images.",
        "Look at these again, in the other order. What changed?",
        ["builtin:checkerboard", "builtin:noise"],
    ),
    (
        "What is in the image?",
        "A short question first. Then: is there a pattern in this image?",
        ["builtin:checkerboard"],
    ),
)
DEFAULT_THRESHOLD = 0.9


@dataclass
class LinkCheck:
    """One model's measured link fidelity for one method."""

    model: str
    fingerprint: str
    method: str
    k: int
    tokens: int
    agreement: float  # top-1 agreement with full recompute, teacher-forced
    mean_kl: float  # KL(full || linked), nats, mean over steps and probes
    probes: int
    created: float
    r: float | None = None  # CacheBlend's recomputed fraction (other methods: None)
    store_budget: float = 1.0  # share of each image's entries its records keep
    store_rank: int = 0  # rank of the records' K/V factors (0: dense)
    pick: str = "first"  # MPIC's choice of recomputed tokens (LinkSpec.pick)

    @property
    def name(self) -> str:
        """:func:`~vlkv.runtime.link.spec.link_label` of the checked method."""
        return link_label(self.method, self.k, self.r, self.pick, self.store_budget, self.store_rank)

    def passes(self, threshold: float) -> bool:
        return self.agreement >= threshold


def checks_dir() -> Path:
    """``${VLKV_CACHE:-~/.cache/vlkv}/link-checks``."""
    return Path(os.environ.get("VLKV_CACHE") or "~/.cache/vlkv").expanduser() / "link-checks"


def check_path(fingerprint: str, spec: LinkSpec, root: Path | None = None) -> Path:
    tag = f"r{spec.r:g}-{spec.deviation}" if spec.method == "cacheblend" else f"k{spec.k}"
    if spec.method == "mpic" and spec.pick != "first":  # another choice of recomputed tokens
        tag += f"-{spec.pick}"
    if spec.store_budget < 1.0:  # compressed records: another fidelity
        tag += f"-b{spec.store_budget:g}-{spec.store_scorer}"
    if spec.store_rank:  # factored records: another fidelity
        tag += f"-rank{spec.store_rank}"
    return (root or checks_dir()) / f"{fingerprint[:24]}-{spec.method}-{tag}.json"


def load_check(fingerprint: str, spec: LinkSpec, root: Path | None = None) -> LinkCheck | None:
    """The saved check for this model and method, or None (also for an unreadable file)."""
    path = check_path(fingerprint, spec, root)
    try:
        data = json.loads(path.read_text())
        check = LinkCheck(**data)
    except (OSError, ValueError, TypeError):
        return None
    return check if check.fingerprint == fingerprint else None


UNCHECKED_ENV = "VLKV_LINK_UNCHECKED"


def unchecked_allowed(threshold: float) -> bool:
    """Whether linking may go ahead without a saved check: threshold 0, or the environment opt-in."""
    return threshold <= 0.0 or os.environ.get(UNCHECKED_ENV, "").strip().lower() in ("1", "true", "yes")


def _pick(spec: LinkSpec) -> str:
    return spec.pick if spec.method == "mpic" else "first"


def refusal(
    check: LinkCheck | None, threshold: float, spec: LinkSpec | None = None, model: str = "this model"
) -> str | None:
    """One line saying why linking is refused, or None when it may go ahead. No saved check refuses
    (default-deny) unless :func:`unchecked_allowed`."""
    if check is None:
        if unchecked_allowed(threshold):
            return None
        what = spec.label if spec is not None else "this method"
        return (
            f"linking refused: {what} was never link-checked on {model} (run vlkv link-check, or opt in "
            f"with --link-threshold 0 or {UNCHECKED_ENV}=1); recomputing instead"
        )
    if check.passes(threshold):
        return None
    return (
        f"linking refused: {check.name} agreed {check.agreement:.2f} < {threshold:.2f} with full "
        f"recompute on {check.model} (vlkv link-check); recomputing instead"
    )


def _forced(engine, batch, cache, out, tokens: list[int]) -> list[torch.Tensor]:
    """Log-probabilities of every step while feeding ``tokens`` (teacher forcing on ``cache``)."""
    from vlkv.runtime.policies import make_policy

    policy, logps = make_policy("full"), [out.logits.float().log_softmax(-1)[0]]
    for step, tok in enumerate(tokens[:-1], start=1):
        out = engine.decode(torch.tensor([tok]), batch, policy, cache, step)
        logps.append(out.logits.float().log_softmax(-1)[0])
    return logps


def run_link_check(engine, spec: LinkSpec, tokens: int = 64, root: Path | None = None) -> LinkCheck:
    """Measure ``spec`` against full recompute on :data:`PROBES` and save the result."""
    from vlkv.runtime.link.records import RecordSource
    from vlkv.runtime.policies import make_policy

    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    pool = engine.new_cache(engine.encode([Prompt("x")])).pool
    agree = kl = 0.0
    steps = 0
    for first, later, imgs in PROBES:
        store = SegmentStore(pool)
        source = RecordSource.for_engine(engine, store)
        p1, p2 = Prompt(first, list(imgs)), Prompt(later, list(reversed(imgs)))
        b1 = engine.encode([p1])
        link_prefill(engine, b1, p1.images, engine.new_cache(b1, pool=pool), spec, source)  # makes records
        b2 = engine.encode([p2])
        full_cache = engine.new_cache(b2, pool=pool)
        full_out = engine.prefill(b2, make_policy("full"), full_cache)
        want = engine.generate([p2], make_policy("full"), tokens, stop_at_eos=False).samples[0].token_ids
        ref = _forced(engine, b2, full_cache, full_out, want)
        cache = engine.new_cache(b2, pool=pool)
        out, _ = link_prefill(engine, b2, p2.images, cache, spec, source)
        got = _forced(engine, b2, cache, out, want)
        for r, g in zip(ref, got):
            agree += float(r.argmax() == g.argmax())
            kl += float((r.exp() * (r - g)).sum())
            steps += 1
        full_cache.release()
        cache.release()
        store.release()
    from vlkv.runtime.store.identity import model_fingerprint

    check = LinkCheck(
        model=getattr(engine.loaded, "name", "model"),
        fingerprint=model_fingerprint(engine.loaded),
        method=spec.method,
        k=spec.k,
        tokens=tokens,
        agreement=agree / steps,
        mean_kl=kl / steps,
        probes=len(PROBES),
        created=time.time(),
        r=spec.r if spec.method == "cacheblend" else None,
        store_budget=spec.store_budget,
        store_rank=spec.store_rank,
        pick=_pick(spec),
    )
    path = check_path(check.fingerprint, spec, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(check), indent=1))
    os.replace(tmp, path)
    return check
