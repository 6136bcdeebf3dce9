"""The Qwen2.5-VL / Qwen3-VL decoder exported as an ONNX graph (rows contract: positions [3, ar] as an input, the
cache outside, DeepStack rows as an input), fed by the static vision graph (test_qwen_vision's, padded to its patch
budget), run on ORT by a minimal host loop over its K/V rows: 24 greedy ids equal
transformers' `generate` in kv mode (the prompt one token per step) and hybrid mode (blocks of PREFILL_AR, an image
straddling a block boundary), with two images of different grids; the graph fed without DeepStack answers otherwise.

This is the graph side of issue 30's decoder; the runtime's Engine feeds these inputs once the decoder contract
(issue 29: positions input, decoder kinds) is merged."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from fixtures_qwen import IMAGE_TOKEN_ID, loaded, vision_graph  # noqa: E402
from test_qwen_language import greedy, prompt_ids, reference  # noqa: E402
from test_qwen_vision import BUDGET, MASK, ops, params, patches_of  # noqa: E402
from vlmrt.families.qwen_vl import vision  # noqa: E402
from vlmrt.runtime import vision_inputs as vi  # noqa: E402
from vlmrt.runtime import mrope  # noqa: E402

KINDS = ("qwen2_5_vl", "qwen3_vl")
MAX_CONTEXT, PREFILL_AR, STEPS = 160, 8, 24


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """kind -> (config, ORT session of the decoder graph: AR 1..PREFILL_AR, cache of MAX_CONTEXT slots)."""
    import onnxruntime as ort

    from vlmrt.export.graphs import CastIO, export_graph, kv_names

    out = {}
    for kind in KINDS:
        cfg, _, _, dec, _, _ = loaded(kind, tmp_path_factory)
        t = cfg.text
        levels = len(cfg.vision.deepstack_layers)
        ar = torch.export.Dim("ar", min=1, max=PREFILL_AR)
        args = [torch.zeros(PREFILL_AR, t.hidden), torch.zeros(3, PREFILL_AR, dtype=torch.int64)]
        names, dims = ["inputs_embeds", "position_ids"], [{0: ar}, {1: ar}]
        if levels:
            args.append(torch.zeros(PREFILL_AR, levels * t.hidden))
            names.append("deepstack")
            dims.append({0: ar})
        args.append(torch.zeros(PREFILL_AR, MAX_CONTEXT + PREFILL_AR))
        names.append("attention_mask")
        dims.append({0: ar, 1: ar + MAX_CONTEXT})
        kin, kout = kv_names(t.layers)
        args += [torch.zeros(MAX_CONTEXT, t.kv_dim) for _ in kin]
        dims += [None] * len(kin)
        path = tmp_path_factory.mktemp(f"{kind}-decoder") / "decoder.onnx"
        export_graph(CastIO(dec, torch.float32, torch.float32), tuple(args), names + kin, ["logits", *kout], path,
                     (tuple(dims),))
        out[kind] = (cfg, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]))
    return out


def encode(cfg, vis, p):
    """(image tokens [n, hidden], DeepStack features [n, levels*hidden] or None) through the vision graph."""
    f = vi.build_feeds(p.patches, p.grid, ops(cfg), params(cfg), BUDGET, MASK)
    outs = [f.restore(o) for o in vis.run(vision.output_names(cfg.vision),
                                          {n: f.feeds[n] for n in vision.input_names(cfg.vision)})]
    return outs[0], (np.concatenate(outs[1:], axis=1) if len(outs) > 1 else None)


def run_graph(cfg, sess, vis, embed, ids, images, mode: str, deepstack: bool = True) -> list[int]:
    """Prompt in kv or hybrid mode, then STEPS greedy tokens: slots advance by one per token, positions as M-RoPE says."""
    t = cfg.text
    levels = len(cfg.vision.deepstack_layers)
    embed = embed.numpy()
    x = embed[ids].copy()
    ds = np.zeros((len(ids), levels * t.hidden), np.float32)
    rows = np.flatnonzero(np.array(ids) == IMAGE_TOKEN_ID)
    enc = [encode(cfg, vis, p) for p in images]
    x[rows] = np.concatenate([e[0] for e in enc])
    if levels and deepstack:
        ds[rows] = np.concatenate([e[1] for e in enc])
    pos = mrope.mrope_positions(ids, [p.grid for p in images], IMAGE_TOKEN_ID, cfg.vision.merge)
    cache = [np.zeros((MAX_CONTEXT, t.kv_dim), np.float32) for _ in range(2 * t.layers)]

    def step(e, p, d, slot):
        n = len(e)
        mask = np.full((n, MAX_CONTEXT + n), MASK, np.float32)
        mask[:, :slot] = 0
        mask[:, MAX_CONTEXT:] = np.triu(np.full((n, n), MASK, np.float32), 1)
        feeds = {"inputs_embeds": e, "position_ids": p, "attention_mask": mask}
        if levels:
            feeds["deepstack"] = d
        for i in range(t.layers):
            feeds[f"past_key_{i}"], feeds[f"past_value_{i}"] = cache[2 * i], cache[2 * i + 1]
        logits, *new = sess.run(None, feeds)
        for c, r in zip(cache, new):
            c[slot:slot + n] = r
        return logits[-1]

    block = 1 if mode == "kv" else PREFILL_AR
    for s in range(0, len(ids), block):
        logits = step(x[s:s + block], pos[:, s:s + block], ds[s:s + block], s)
    out, slot, at = [], len(ids), mrope.next_position(pos)
    for _ in range(STEPS):
        tok = greedy(logits)
        out.append(tok)
        logits = step(embed[[tok]], np.full((3, 1), at, np.int64), np.zeros((1, levels * t.hidden), np.float32), slot)
        slot, at = slot + 1, at + 1
    return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """kind -> (prompt ids, images, transformers' 24 greedy ids, the vision graph, embedding table)."""
    out = {}
    for kind in KINDS:
        cfg, model, _, _, embed, _ = loaded(kind, tmp_path_factory)
        images = [patches_of(kind, (140, 154), seed=6), patches_of(kind, (56, 112), seed=7)]
        ids = prompt_ids([p.tokens for p in images], seed=2)
        runs = mrope.image_runs(np.array(ids), IMAGE_TOKEN_ID)
        assert any(a // PREFILL_AR != (b - 1) // PREFILL_AR for a, b in runs)  # an image straddles a block boundary
        out[kind] = (ids, images, reference(model, ids, images, STEPS)[1], vision_graph(kind, tmp_path_factory, BUDGET),
                     embed)
    return out


@pytest.mark.parametrize("mode", ["kv", "hybrid"])
@pytest.mark.parametrize("kind", KINDS)
def test_graph_greedy_ids_equal_generate(kind, mode, graphs, cases):
    cfg, sess = graphs[kind]
    ids, images, want, vis, embed = cases[kind]
    assert run_graph(cfg, sess, vis, embed, ids, images, mode) == want


def test_graph_without_deepstack_differs(graphs, cases):
    cfg, sess = graphs["qwen3_vl"]
    ids, images, want, vis, embed = cases["qwen3_vl"]
    assert run_graph(cfg, sess, vis, embed, ids, images, "hybrid", deepstack=False) != want
