"""Phase A, the decoder side: a LoRA on every linear of the last decoder layers, trained with the fixed concept
prompts P[colour, shape] (the decoder's own word embeddings of the image's colour and shape) in the image slots.
The first layers are frozen and see only (question, colour, shape): their output is computed once per distinct
prompt (no grad) and cached, so later epochs cost a fraction of a decoder pass.
Writes OUT/lora.safetensors and OUT/phase_a.json."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .lora import add_lora
from .prepare import Start
from .schedule import cosine
from .score import evaluate


def training_prompts(s: Start, max_prompts: int, g: torch.Generator) -> dict[tuple[str, int, int], str]:
    """Distinct training prompts (question, colour, shape) -> answer from the train split; --max-prompts keeps
    every question with a seeded few of its (colour, shape) combinations; a seeded eighth of the prompts have
    the question capitalized (as users type it)."""
    combos: dict[tuple[str, int, int], str] = {}
    for q, ans, im in s.rows_a:
        combos[(q, *s.lab_train[im])] = ans
    keys_a = sorted(combos)
    if max_prompts and max_prompts < len(keys_a):
        by_q: dict[str, list] = {}
        for key in keys_a:
            by_q.setdefault(key[0], []).append(key)
        lists = [[by_q[q][j] for j in torch.randperm(len(by_q[q]), generator=g).tolist()] for q in sorted(by_q)]
        keep: list = []
        while len(keep) < max_prompts:
            for lst in lists:
                if lst and len(keep) < max_prompts:
                    keep.append(lst.pop(0))
        combos = {k: combos[k] for k in keep}
        keys_a = sorted(combos)
    perm = torch.randperm(len(keys_a), generator=g).tolist()
    for j in perm[: len(keys_a) // 8]:
        q, c, k = keys_a[j]
        combos[(q[0].upper() + q[1:], c, k)] = combos.pop(keys_a[j])
    return combos


def phase_a(a, s: Start, log, out: Path) -> int:
    model, batcher, P, g = s.model, s.batcher, s.P, s.g
    from safetensors.torch import save_file

    tm = model.model.text_model
    n_layers = len(tm.layers)
    first = n_layers - a.lora_layers
    loras = add_lora(tm, a.lora_rank, first, g)
    lora_params = [p for m in loras.values() for p in (m.lora_A, m.lora_B)]
    opt = torch.optim.AdamW(lora_params, lr=a.lr, weight_decay=0.0)
    combos = training_prompts(s, a.max_prompts, g)
    keys_a = sorted(combos)
    log(f"phase A: {len(keys_a)} distinct (question, colour, shape) prompts; LoRA r={a.lora_rank} on layers {first}..{n_layers - 1}")
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # combo -> (hidden [T, 576] entering layer `first`, labels [T])

    def causal(T: int) -> torch.Tensor:  # right padding + causal mask: pads never reach real positions
        return torch.full((T, T), float("-inf")).triu(1)[None, None]

    def run_layers(h, lo, hi):
        T = h.shape[1]
        pos = torch.arange(T)[None].expand(h.shape[0], T)
        pe = tm.rotary_emb(h, position_ids=pos)
        mask = causal(T)
        for layer in tm.layers[lo:hi]:
            h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        return h

    def fill(idx: list[int]) -> None:
        todo = [j for j in idx if j not in cache]
        if not todo:
            return
        rows = [(keys_a[j][0], combos[keys_a[j]], 0) for j in todo]
        ids, attn, labels, _ = batcher(rows, None)
        img = torch.stack([P[keys_a[j][1], keys_a[j][2]] for j in todo])  # [b, 4, 576]
        with torch.no_grad():
            emb = tm.embed_tokens(ids).masked_scatter((ids == batcher.image_id)[..., None], img)
            h = run_layers(emb, 0, first)
        for b, j in enumerate(todo):
            n = int(attn[b].sum())
            cache[j] = (h[b, :n].clone(), labels[b, :n].clone())

    curve = {"step": [], "loss": [], "val_step": [], "val_acc": [], "vision_step": [], "vision_loss": [], "vision_acc": []}
    val_known = [r for r in s.val_rows if r[2] in {i for i, (c, k) in s.lab_test.items() if c >= 0 and k >= 0}]
    model.train()
    t_a = time.time()
    order = []
    step = 0
    for step in range(1, a.steps + 1):
        opt.param_groups[0]["lr"] = a.lr * cosine(step, a.steps, 10)
        if len(order) < a.batch:
            order += torch.randperm(len(keys_a), generator=g).tolist()
        idx, order = order[: a.batch], order[a.batch:]
        fill(idx)
        T = max(cache[j][0].shape[0] for j in idx)
        h = torch.zeros(len(idx), T, P.shape[-1])
        labels = torch.full((len(idx), T), -100, dtype=torch.long)
        for b, j in enumerate(idx):
            n = cache[j][0].shape[0]
            h[b, :n], labels[b, :n] = cache[j]
        hid = tm.norm(run_layers(h, first, n_layers))
        sel = labels != -100
        loss = nn.functional.cross_entropy(model.lm_head(hid[sel]), labels[sel])
        opt.zero_grad()
        loss.backward()
        opt.step()
        curve["step"].append(step)
        curve["loss"].append(loss.item())
        if step % 10 == 0:
            log(f"A step {step} loss {np.mean(curve['loss'][-10:]):.4f} ({(time.time() - t_a) / step:.2f} s/step, {len(cache)} cached)")
        over = a.time_budget and time.time() - t_a > a.time_budget
        if step % a.eval_every == 0 or step == a.steps or over:
            acc = evaluate(model, batcher, val_known, s.val_images, concepts=P, labels_of=s.lab_test)
            curve["val_step"].append(step), curve["val_acc"].append(acc)
            log(f"A step {step} val exact match (labelled concepts) {acc:.3f}")
        if over:
            log(f"time budget {a.time_budget:.0f} s reached at step {step}")
            break
    t_a = time.time() - t_a

    log(f"phase A done: {step} steps in {t_a:.0f} s")
    save_file({n + k: getattr(m, k[1:]).detach().clone().contiguous() for n, m in loras.items() for k in (".lora_A", ".lora_B")},
              str(out / "lora.safetensors"))
    (out / "phase_a.json").write_text(json.dumps({"steps": step, "lr": a.lr, "lora_rank": a.lora_rank, "time_s": round(t_a, 1), "prompts": len(keys_a), "curve": curve}) + "\n")
    return 0
