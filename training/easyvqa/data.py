"""The training data as tensors: easy-VQA images normalized as the bundle does, tokenized (prompt + answer)
batches, and the concept prompts that stand in for the image tokens."""

from __future__ import annotations

import numpy as np
import torch

from vlmrt.demo import easyvqa_data as ev


def load_images(split: str, ids) -> dict[int, np.ndarray]:
    """image id -> [3, 64, 64] float32, normalized as the bundle does ((x/255 - 0.5) / 0.5)."""
    from PIL import Image

    out = {}
    for i in sorted(set(ids)):
        a = np.asarray(Image.open(ev.image_path(split, i)).convert("RGB"), dtype=np.float32)
        out[i] = ((a / np.float32(255.0) - np.float32(0.5)) / np.float32(0.5)).transpose(2, 0, 1).copy()
    return out


class Batcher:
    """Tokenized (prompt + answer) rows, right-padded; labels = -100 except on the answer tokens."""

    def __init__(self, tok, pad_id: int, image_id: int):
        self.tok, self.pad_id, self.image_id, self.cache = tok, pad_id, image_id, {}

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
