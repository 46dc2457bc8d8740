"""Probe: text-trained rank-8 q/k/v/o adapters folded onto the shipped projector -> a projector file."""

import sys
import time

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from vlkv.eval.scene_tasks import two
from vlkv.eval.text_ceiling import FORMS
from vlkv.runtime.engine import Engine
from vlkv.runtime.models import lm_lora
from vlkv.runtime.models.registry import load_model
from vlkv.runtime.models.smollm2_llava import PROJECTOR_FILE
from vlkv.runtime.prompt import Prompt

torch.manual_seed(0)
torch.set_num_threads(1)
loaded = load_model("smollm2-llava")
engine = Engine(loaded)
model = loaded.model
tok = loaded.processor.tokenizer


def text(scene, q, form):
    return FORMS[form](*(o.name for o in scene.objects)) + " " + q


params = lm_lora.attach(model, 8, ("q_proj", "k_proj", "v_proj", "o_proj"), 16.0, 0)
for p in model.parameters():
    p.requires_grad_(False)
for p in params:
    p.requires_grad_(True)
opt = torch.optim.AdamW(params, lr=float(sys.argv[2]))
rng = np.random.default_rng(1)
end = tok.convert_tokens_to_ids("<|im_end|>")
t0 = time.time()
for step in range(int(sys.argv[1])):
    seqs, labels = [], []
    for _ in range(8):
        s = two(rng, "train")
        form = ("caption", "sides")[rng.integers(2)]
        ids = engine.encode([Prompt(text(s.scenes[0], s.question, form), [])]).input_ids[0].tolist()
        ans = tok(s.answer, add_special_tokens=False).input_ids + [end]
        seqs.append(ids + ans)
        labels.append([-100] * len(ids) + ans)
    n = max(map(len, seqs))
    x = torch.tensor([q + [tok.pad_token_id or 0] * (n - len(q)) for q in seqs])
    y = torch.tensor([lab + [-100] * (n - len(lab)) for lab in labels])
    att = torch.tensor([[1] * len(q) + [0] * (n - len(q)) for q in seqs])
    loss = model(input_ids=x, attention_mask=att, labels=y).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 25 == 0:
        print(step, round(loss.item(), 3), round(time.time() - t0), flush=True)
raw = lm_lora.raw_state(model)
torch.save(raw, sys.argv[3] + ".pt")
tensors = load_file(str(PROJECTOR_FILE)) | lm_lora.fold(raw, 16.0 / 8)
save_file(tensors, sys.argv[3])
print("saved", sys.argv[3], round(time.time() - t0))
