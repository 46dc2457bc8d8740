import math
import sys
from pathlib import Path

import torch

from tests.runtime.models.test_smollm2_llava import PARAGRAPH
from vlkv.eval.vqa import _swap_projector
from vlkv.runtime.models import smollm2_llava as S
from vlkv.runtime.models.registry import load_model

torch.set_num_threads(1)
for name in sys.argv[1:]:
    loaded = load_model("smollm2-llava-random")
    _swap_projector(loaded, Path(name))
    model, tok = loaded.model, loaded.processor.tokenizer
    ids = tok(PARAGRAPH, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        ppl = math.exp(model(input_ids=ids, labels=ids).loss.item())
        t = tok(
            S.prompt_template("The capital of France is", 0), return_tensors="pt", add_special_tokens=False
        )
        out = model.generate(**t, max_new_tokens=8, do_sample=False)
    print(
        Path(name).name,
        "perplexity",
        round(ppl, 2),
        "| France ->",
        repr(tok.decode(out[0, t["input_ids"].shape[1] :])),
        flush=True,
    )
