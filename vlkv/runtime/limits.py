"""Up-front size checks: refuse a request the model cannot take before any model compute.

A prompt past the language model's position limit (``max_position_embeddings``) either runs for
minutes on positions the model never saw or, on small models with big prompts, allocates
attention scores quadratic in its length until the machine runs out of memory. Tokenizing is cheap,
so the prompt lengths are known before the first layer runs: check them there.
"""

from __future__ import annotations

from collections.abc import Sequence


class LimitError(ValueError):
    """A request larger than the model takes (one-line message naming the sizes)."""


def position_limit(model) -> int | None:
    """The language model's ``max_position_embeddings`` (a ``LoadedModel``, HF model or config).

    Reads ``config.text_config`` first (LLaVA, LLaVA-NeXT, Qwen2-VL), then the config itself;
    None when the config states no limit.
    """
    config = getattr(getattr(model, "model", model), "config", model)
    for cfg in (getattr(config, "text_config", None), config):
        limit = getattr(cfg, "max_position_embeddings", None)
        if isinstance(limit, int) and limit > 0:
            return limit
    return None


def check_fits(
    prompt_tokens: Sequence[int], max_new_tokens: int, limit: int | None, model: str = "the model"
) -> None:
    """Raise :class:`LimitError` when a prompt plus ``max_new_tokens`` needs more than ``limit`` positions.

    Args:
        prompt_tokens: tokens per prompt after image-token expansion (e.g. ``PromptBatch.lengths.tolist()``).
        max_new_tokens: tokens to generate per prompt, >= 0.
        limit: the model's position limit (:func:`position_limit`); None checks nothing.
        model: the model's name, for the message.

    The message names the first prompt that does not fit, its size, the limit, and how many other
    prompts are too long.
    """
    if limit is None:
        return
    lengths = [int(n) for n in prompt_tokens]
    over = [i for i, n in enumerate(lengths) if n + max_new_tokens > limit]
    if not over:
        return
    first = over[0]
    which = f"prompt {first + 1} of {len(lengths)}" if len(lengths) > 1 else "the prompt"
    more = f" ({len(over) - 1} more prompt(s) too long)" if len(over) > 1 else ""
    need = lengths[first] + max_new_tokens
    raise LimitError(
        f"{which} is {lengths[first]} tokens; with max_new_tokens {max_new_tokens} it needs {need} "
        f"positions, past {model}'s limit of {limit} (max_position_embeddings): shorten the prompt or "
        f"generate fewer tokens{more}"
    )
