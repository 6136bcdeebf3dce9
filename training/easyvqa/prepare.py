"""What every phase starts from: seeds and torch settings, the easy-VQA splits and images, the base
checkpoint (SmolLM2-135M-Instruct decoder + a freshly initialized "easyvqa" vision tower), the concept prompts.
The order of these steps fixes the random streams the phases draw from: keep it."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from vlmrt.demo import easyvqa_data as ev
from vlmrt.demo.smollm2 import build_smolvlm_checkpoint

from .data import Batcher, concept_embeds, load_images

PRESET = "easyvqa"


@dataclass
class Start:
    lab_train: dict  # image id -> (colour, shape) indices, -1 where the questions do not tell
    lab_test: dict
    known: set  # train images whose colour and shape are both known
    rows_a: list  # train rows on a known image (phase A)
    val_rows: list  # the stratified test questions scored during training
    images: dict  # train image id -> [3, 64, 64]
    val_images: dict
    model: torch.nn.Module  # SmolVLMForConditionalGeneration, every parameter frozen
    tok: object  # tokenizers.Tokenizer
    batcher: Batcher
    g: torch.Generator  # the seeded generator every later draw takes
    P: torch.Tensor  # concept prompts [8 colours, 3 shapes, 4, 576]


def prepare(a, log) -> Start:
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    torch.use_deterministic_algorithms(True)
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
    batcher = Batcher(tok, cfg["pad_token_id"], cfg["image_token_id"])
    g = torch.Generator().manual_seed(a.seed)
    P = concept_embeds(model, tok)  # [8, 3, 4, 576]
    return Start(lab_train, lab_test, known, rows_a, val_rows, images, val_images, model, tok, batcher, g, P)
