"""``scripts/train_projector.py``'s run settings: one dataclass, checked on construction.

Every checkpoint holds them, and a resume must match them (settings added since take their defaults).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vlkv.eval import route_loss
from vlkv.eval.projector_init import HIDDEN, POSITION_BIASES, TARGETS
from vlkv.eval.scene_tasks import LABELS, MIXES, QUESTION_ORDERS
from vlkv.runtime.models import lm_lora
from vlkv.runtime.models.projector_order import ORDERS
from vlkv.runtime.models.projector_pool import POOLS

FORMS = ("mlp", "linear")


@dataclass
class TrainConfig:
    """One run's settings; written into every checkpoint, and a resume must match them."""

    model: str = "smollm2-llava-random"
    steps: int = 400
    batch: int = 4
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    clip: float = 1.0
    seed: int = 0
    init_images: int = 300
    ridge: float = 1e-2  # ridge penalty relative to the mean feature variance
    eval_every: int = 50
    eval_scenes: int = 16
    # bfloat16 autocast of the LM-loss steps: 1.8x less CPU time per sample here (avx512_bf16), same
    # loss to 3 digits; the projector's weights and optimiser stay float32
    autocast: str = "bf16"
    mix: str = "full"  # a key of vlkv.eval.scene_tasks.MIXES
    # a checkpoint.pt (or a shipped projector .safetensors) whose projector replaces the ridge
    # initialisation (a second phase of training)
    init_from: str = ""
    # "mlp": the whole MLP trains. "linear": only the ridge map's coefficients and bias train (the
    # principal directions stay), so the projector stays an affine map of the vision features and
    # cannot learn pair-specific non-linear codes; it is written exactly into the MLP when saved.
    form: str = "mlp"
    # the ridge fit's target (vlkv.eval.projector_init): "global" (every patch of a one-object scene
    # -> its words), "local" (patches on an object -> its words, others -> "background") or
    # "local-pos" (as local, plus the object's position word: "red star left")
    init_target: str = "global"
    # the ridge map's hidden units: "unit" RMS pre-activations, or "raw" principal coordinates (the
    # same function; it sets how far optimiser steps move each layer, vlkv.eval.projector_init)
    init_hidden: str = "unit"
    # pull toward the starting projector: the loss gains anchor * sum over tensors of
    # |W - W0|^2 / |W0|^2 (relative, so linear_2's ~100x smaller weights are held as firmly as
    # linear_1's). A prior around a compositional map, against pair-specific codes; 0 = off
    anchor: float = 0.0
    # picture labels in several-picture prompts (vlkv.eval.scene_tasks.LABELS): "none" (the bare
    # template) or "ordinal" ("The seventh picture:" before the seventh image)
    labels: str = "none"
    # a learned per-patch term added to the projector's output (vlkv.runtime.models.projector_position):
    # "none", or "thirds" (started at position_alpha x the input embedding of the patch column's
    # third, "left" / "middle" / "right"; then it trains with the MLP)
    position_bias: str = "none"
    position_alpha: float = 0.5
    # the bias's learning rate as a multiple of lr: at lr 1e-4 Adam moves it ~3 % in 100 steps
    # (measured, alpha 0.2), i.e. it stays where geometry put it
    position_lr_scale: float = 1.0
    # low-rank adapters on the LM's projections (vlkv.runtime.models.lm_lora), trained with the
    # projector: 0 = the LM stays frozen. Targets: comma-separated projection names; alpha / rank is
    # the adapter's scale; the adapters' learning rate is lr x lm_lora_lr_scale
    lm_lora_rank: int = 0
    lm_lora_targets: str = "q_proj,v_proj"
    lm_lora_alpha: float = 16.0
    lm_lora_lr_scale: float = 1.0
    # the projector's learning rate as a multiple of lr (0: it stays as started, only adapters train)
    projector_lr_scale: float = 1.0
    # the order of the image tokens (vlkv.runtime.models.projector_order): "raster" (the tower's
    # row-major patches) or "columns" (column-major: each object's patches one contiguous run, the
    # left object's first); a raster-order checkpoint may start a columns run (--init-from)
    token_order: str = "raster"
    # average-pool the patch raster in blocks of pool x pool before the MLP
    # (vlkv.runtime.models.projector_pool): 1 = off, 2 = 16x16 patches -> 8x8 = 64 image tokens. The
    # ridge fit is per pooled token; an unpooled checkpoint may start a pooled run (--init-from)
    pool: int = 1
    # stage 2 (vlkv.eval.text_scenes): the fraction of each batch's samples asked about a description
    # of their scenes instead of the images (the adapters learn the questions from text), and the
    # weight of KL(the model given the description || the model given the images) on image samples
    text_mix: float = 0.0
    distill: float = 0.0
    # the weight of the hidden-state match on image samples: every layer's states over the tokens
    # the image prompt and the description prompt end with (question, answers), teacher no gradient
    distill_hidden: float = 0.0
    # keep general text as the base LM had it (vlkv.eval.keep_text): each step adds keep_text x
    # KL(LM with adapters off || with adapters) over keep_text_items plain-text items (chat turns and
    # prose, drawn on their own stream); 0 = off, and the run draws what it drew before
    keep_text: float = 0.0
    keep_text_items: int = 2
    # train the vision tower's last vision_blocks blocks before the layer the projector reads
    # (vlkv.eval.vision_tune: 0 = frozen), at lr x vision_lr_scale; kept in checkpoints and exports
    vision_blocks: int = 0
    vision_lr_scale: float = 0.1
    # answer-word corruption (vlkv.eval.answer_noise): each answer, with this probability, has one
    # colour / shape word that another answer word follows replaced in the teacher-forced input by
    # another of its kind (targets clean), so the next word must be read from the image; 0 = off
    answer_noise: float = 0.0
    # where image prompts put the question (vlkv.eval.scene_tasks.QUESTION_ORDERS): "after" the images
    # (the product's template), "before" them, or "both"; description (text-form) prompts keep theirs
    question_order: str = "after"
    # routing supervision (vlkv.eval.route_loss): route_loss x -log(the answer row's head-mean attention
    # on the asked object's image tokens / on all image tokens), in the LM layers route_layers
    # (comma-separated), for one-picture samples about one object; 0 = off (today's steps)
    route_loss: float = 0.0
    route_layers: str = "13,16,19,22"
    # the ratio's denominator (vlkv.eval.route_loss.OVER): "image" (all image tokens) or "objects"
    # (the asked and the other object's tokens only: binding alone)
    route_over: str = "image"

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "init_images", "eval_scenes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.anchor < 0:
            raise ValueError(f"anchor must be >= 0, got {self.anchor}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")
        if self.autocast not in ("bf16", "fp32"):
            raise ValueError(f"autocast must be bf16 or fp32, got {self.autocast!r}")
        for name, options in (
            ("form", FORMS),
            ("mix", MIXES),
            ("init_target", TARGETS),
            ("labels", LABELS),
            ("question_order", QUESTION_ORDERS),
            ("init_hidden", HIDDEN),
            ("position_bias", POSITION_BIASES),
            ("token_order", ORDERS),
            ("pool", POOLS),
            ("route_over", route_loss.OVER),
        ):
            if getattr(self, name) not in options:
                raise ValueError(f"{name} must be one of {list(options)}, got {getattr(self, name)!r}")
        if self.token_order != "raster" and (self.form != "mlp" or self.position_bias != "none"):
            raise ValueError(
                f"token_order {self.token_order!r} needs form mlp and no position_bias, "
                f"got {self.form!r} / {self.position_bias!r}"
            )
        if self.pool > 1 and (self.form, self.position_bias, self.token_order) != ("mlp", "none", "raster"):
            raise ValueError(
                f"pool {self.pool} needs form mlp, no position_bias and raster order, got "
                f"{self.form!r} / {self.position_bias!r} / {self.token_order!r}"
            )
        if self.position_bias != "none" and self.form != "mlp":
            raise ValueError(f"position_bias {self.position_bias!r} needs form mlp, got {self.form!r}")
        if self.projector_lr_scale < 0:
            raise ValueError(f"projector_lr_scale must be >= 0, got {self.projector_lr_scale}")
        if self.position_lr_scale <= 0:
            raise ValueError(f"position_lr_scale must be > 0, got {self.position_lr_scale}")
        if self.position_alpha < 0:
            raise ValueError(f"position_alpha must be >= 0, got {self.position_alpha}")
        if self.lm_lora_rank < 0:
            raise ValueError(f"lm_lora_rank must be >= 0, got {self.lm_lora_rank}")
        if self.lm_lora_rank and (self.lm_lora_alpha <= 0 or self.lm_lora_lr_scale <= 0):
            raise ValueError("lm_lora_alpha and lm_lora_lr_scale must be > 0")
        lm_lora.parse_targets(self.lm_lora_targets)
        if self.lm_lora_rank and self.anchor > 0:  # the anchor is relative to |W0|: B starts at zero
            raise ValueError(
                "anchor pulls toward the starting projector; it cannot be used with lm_lora_rank"
            )
        if not 0 <= self.text_mix <= 1:
            raise ValueError(f"text_mix must be in [0, 1], got {self.text_mix}")
        if self.distill < 0 or self.distill_hidden < 0:
            raise ValueError(
                f"distill and distill_hidden must be >= 0, got {self.distill}, {self.distill_hidden}"
            )
        if self.keep_text < 0 or self.keep_text_items < 1:
            raise ValueError(
                f"keep_text must be >= 0 and keep_text_items >= 1, got {self.keep_text}, {self.keep_text_items}"
            )
        if self.keep_text > 0 and not self.lm_lora_rank:  # only the adapters change text-only outputs
            raise ValueError("keep_text holds the LM adapters to the base LM: it needs lm_lora_rank >= 1")
        if self.text_mix > 0 and not self.lm_lora_rank:  # text samples reach only the LM's adapters
            raise ValueError("text_mix trains the LM adapters from text: it needs lm_lora_rank >= 1")
        if self.vision_blocks < 0 or self.vision_lr_scale <= 0:
            raise ValueError(
                f"vision_blocks must be >= 0 and vision_lr_scale > 0, got {self.vision_blocks}, {self.vision_lr_scale}"
            )
        if not 0 <= self.answer_noise <= 1:
            raise ValueError(f"answer_noise must be in [0, 1], got {self.answer_noise}")
        if self.route_loss < 0:
            raise ValueError(f"route_loss must be >= 0, got {self.route_loss}")
        route_loss.parse_layers(self.route_layers)
        if self.init_from and not Path(self.init_from).is_file():
            raise ValueError(f"init_from {self.init_from} is not a file")
