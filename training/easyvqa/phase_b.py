"""Phase B, the vision side (no decoder): the SigLIP tower with a linear probe on the images' (colour, shape)
labels, the connector solved by ridge regression onto the concept prompts, then tower + probe + connector trained
together, and the connector solved once more. Writes OUT/vision.safetensors and OUT/phase_b.json."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from vlmrt.demo import easyvqa_data as ev

from .data import load_images
from .prepare import Start
from .schedule import cosine


def phase_b(a, s: Start, log, out: Path) -> int:
    """Vision side, no decoder, two stages:
    (1) tower + mean-pooled linear probe on (colour, shape), cross-entropy (--vision-steps);
    (2) the connector (pixel shuffle -> Linear 1536 -> 576, no bias) is solved in closed form by ridge
        regression onto the concept prompt P[c, s] of each training image's labels, then tower, probe and
        connector train together on probe CE + the connector's relative squared error to P[c, s]
        (--connector-steps): each of the 4 image tokens sees one 32 px quadrant after the pixel shuffle,
        so the tower must spread the colour and shape to every quadrant -- the probe alone does not ask it;
    then the connector is solved by ridge regression once more (the least-squares optimum for the tower)."""
    model, P, images, lab_train, lab_test, known, g = s.model, s.P, s.images, s.lab_train, s.lab_test, s.known, s.g
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
