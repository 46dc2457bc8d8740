"""An offline byte-level tokenizer for the built-in tiny models.

Ids are fixed so that tests and reports can name them: byte ``b`` is id ``b`` (0..255), then the
special tokens in the order of :data:`SPECIAL_TOKENS` for the family. Nothing is downloaded.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

# Special tokens per family, in id order starting at 256. The Qwen2-VL list carries the names that
# ``Qwen2VLProcessor`` and ``Qwen2VLModel.get_rope_index`` look up (``<|video_pad|>`` included,
# because the processor resolves it at construction even when no video is ever passed).
SPECIAL_TOKENS: dict[str, tuple[str, ...]] = {
    "llava": ("<pad>", "<s>", "</s>", "<image>"),
    "qwen2_vl": (
        "<pad>",
        "<s>",
        "</s>",
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ),
}
# LLaVA-NeXT shares LLaVA's vocabulary and conventions.
SPECIAL_TOKENS["llava_next"] = SPECIAL_TOKENS["llava"]

IMAGE_TOKEN: dict[str, str] = {"llava": "<image>", "llava_next": "<image>", "qwen2_vl": "<|image_pad|>"}
NUM_BYTES = 256


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map, which ``ByteLevel`` pre-tokenizers use."""
    printable = list(range(ord("!"), ord("~") + 1))
    printable += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(NUM_BYTES):
        if b not in printable:
            printable.append(b)
            chars.append(NUM_BYTES + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def vocab_size(family: str) -> int:
    """Number of real tokens (bytes + specials) for ``family``, before any embedding padding."""
    return NUM_BYTES + len(_specials(family))


def _specials(family: str) -> tuple[str, ...]:
    if family not in SPECIAL_TOKENS:
        raise ValueError(f"family must be one of {sorted(SPECIAL_TOKENS)}, got {family!r}")
    return SPECIAL_TOKENS[family]


def build_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """Build the byte-level tokenizer for ``family`` ("llava", "llava_next" or "qwen2_vl").

    LLaVA-style tokenizers prepend ``<s>`` to every encoded text, as Llama's do; the Qwen2-VL one
    adds nothing, as Qwen2's does. ``</s>`` is the eos token and ``<pad>`` the pad token in both.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    specials = _specials(family)
    byte_vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    # A BPE with no merges over the 256 byte symbols is exactly "one token per byte".
    tok = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if family in ("llava", "llava_next"):
        bos = "<s>"
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, bos_id)]
        )
    extra = {"image_token": IMAGE_TOKEN[family]}
    if family == "qwen2_vl":
        extra |= {"video_token": "<|video_pad|>", "vision_bos_token": "<|vision_start|>"}
        extra |= {"vision_eos_token": "<|vision_end|>"}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        padding_side="left",
        extra_special_tokens=extra,
    )
