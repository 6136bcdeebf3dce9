"""Teacher-forced exact match of the model (or of the decoder with concept prompts in the image slots)."""

from __future__ import annotations

import torch


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
