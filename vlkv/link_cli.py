"""``vlkv link-check``, and the linking flags it shares with ``vlkv generate``.

Wired into ``vlkv`` by :func:`add_link_check_parser`; ``generate`` adds the same flags with
:func:`add_link_args` and reads them back with :func:`link_spec`, so a new linking setting is one flag
and one field here for both commands.
"""

from __future__ import annotations

import argparse
import json

from vlkv.cli_common import CliError, info
from vlkv.runtime.link.spec import PICKS

MPIC_K = 32  # LinkSpec's own default k, the flag's when it is left out


def add_link_args(p: argparse.ArgumentParser, k_default: int | None) -> None:
    """MPIC's / CacheBlend's settings and what new records keep; ``k_default`` None: ``--link-k`` left
    out reads as None (``generate`` tells "no k asked" from "k = 32")."""
    p.add_argument(
        "--link-k",
        type=int,
        default=k_default,
        help=f"MPIC: leading tokens of each image to recompute ({MPIC_K})",
    )
    p.add_argument(
        "--link-pick",
        default="first",
        choices=PICKS,
        help="MPIC: which image tokens to recompute: each image's first k (first), or k per image on average, "
        "more for later images (ramp)",
    )
    p.add_argument(
        "--link-r",
        type=float,
        default=0.15,
        help="CacheBlend: fraction of stored image tokens recomputed, by check-layer deviation (0.15)",
    )
    p.add_argument(
        "--link-deviation", default="k", help="CacheBlend: deviation measured on k (keys) or v (values)"
    )
    p.add_argument(
        "--store-budget",
        type=float,
        default=1.0,
        help="share of each image's entries its new records keep (compressed below 1; default 1)",
    )
    p.add_argument(
        "--store-scorer",
        default="keynorm",
        help="which entries a compressed record keeps: keynorm, stride or kvzip",
    )
    p.add_argument(
        "--store-rank",
        type=int,
        default=0,
        help="store new records' K/V as joint-head low-rank factors of this rank (0: dense; default 0)",
    )


def link_spec(args: argparse.Namespace):
    """The :class:`~vlkv.runtime.link.spec.LinkSpec` the flags of :func:`add_link_args` and ``--link``
    ask for (its ``__post_init__`` names a bad value in one line)."""
    from vlkv.runtime.link.spec import LinkSpec

    return LinkSpec(
        method=args.link,
        k=MPIC_K if args.link_k is None else args.link_k,
        r=args.link_r,
        deviation=args.link_deviation,
        store_budget=args.store_budget,
        store_scorer=args.store_scorer,
        store_rank=args.store_rank,
        pick=args.link_pick,
    )


def add_link_check_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``link-check`` to ``subparsers`` (the ``vlkv`` command's)."""
    c = subparsers.add_parser(
        "link-check", help="measure linked-vs-full fidelity on built-in probes; saved beside the model"
    )
    c.add_argument("--model", default="tiny-llava")
    c.add_argument("--link", default="mpic", help="prefix, full-reuse, cacheblend or mpic (default: mpic)")
    add_link_args(c, k_default=MPIC_K)
    c.add_argument("--tokens", type=int, default=64, help="teacher-forced tokens per probe (default: 64)")
    c.add_argument("--threshold", type=float, default=None, help="agreement needed to link (default 0.9)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_link_check)
    return c


def cmd_link_check(args) -> int:
    from vlkv.runtime.engine import Engine
    from vlkv.runtime.link.gate import DEFAULT_THRESHOLD, run_link_check
    from vlkv.runtime.models.registry import load_model

    spec = link_spec(args)
    if spec.method == "none":
        raise CliError("link-check measures a linking method: --link prefix, full-reuse, cacheblend or mpic")
    threshold = DEFAULT_THRESHOLD if args.threshold is None else args.threshold
    if not 0.0 <= threshold <= 1.0:
        raise CliError(f"--threshold must be in [0, 1], got {threshold}")
    info(
        f"-- link-check: {args.model} {spec.label}, linked vs full prefill on the built-in probes "
        f"({args.tokens} tokens each); about a minute on 2 CPU cores"
    )
    check = run_link_check(Engine(load_model(args.model)), spec, args.tokens)
    verdict = "passes" if check.passes(threshold) else "is refused"
    if args.json:
        from dataclasses import asdict

        print(
            json.dumps({**asdict(check), "threshold": threshold, "passes": check.passes(threshold)}, indent=2)
        )
    else:
        print(
            f"{check.model} {spec.label}: top-1 agreement {check.agreement:.3f}, mean KL "
            f"{check.mean_kl:.4f} over {check.probes} probes x {check.tokens} tokens; linking {verdict} at {threshold:.2f}"
        )
    return 0
