"""Qwen3.5 bundles (family_cases.QWEN_CASES' qwen3.5 cases) where their recurrent state is what is tested, beyond the
shared runner and test_qwen_vl.py: a long text prompt whose state crosses many prefill blocks equals transformers in
both modes (snapshots taken at the block ends); lookahead with rejected drafts gives plain decoding's ids and leaves
the recurrent state, the conv windows and the K/V rows plain decoding's (each partly rejected call run again), and
without that replay the state and the answer part from it; static graphs keep a padded block out of the state;
configs vlmrt cannot export are refused in one line naming the field, nothing written."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from family_cases import QWEN_CASES, qwen_exported

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import oracle  # noqa: E402
from vlmrt.runtime.vlm import VLM  # noqa: E402

CASES = [c for c in QWEN_CASES if c.kind == "qwen3_5"]
LONG = ("Tell me everything about the red fox, the grey wolf and the brown bear: where they live, what they eat, how "
        "they raise their young, and how each of them spends a long cold winter in the northern forests. ") * 3


@pytest.fixture(params=CASES, ids=[c.name for c in CASES])
def ex(request, tmp_path_factory):
    return qwen_exported(request.param, tmp_path_factory)


def hf_ids(ex, text: str, n: int) -> tuple[list[int], list[int]]:
    model, proc = ex.hf()
    turns = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    inputs = proc(text=[proc.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)],
                  return_tensors="pt")
    return inputs["input_ids"][0].tolist(), oracle.greedy_new_ids(model, inputs, n, ignore_eos=True)


@pytest.mark.parametrize("mode", ["kv", "hybrid"])
def test_long_prompt_across_many_blocks_equals_transformers(ex, mode):
    ids, want = hf_ids(ex, LONG, 24)
    assert len(ids) > 20 * ex.case.prefill_ar  # the state is carried across 20+ blocks
    r = VLM.load(ex.bundle)(LONG, mode=mode, max_new_tokens=24, ignore_eos=True)
    assert r.prompt_ids == ids and len(set(want)) > 4 and r.token_ids == want
    blocks = len(ids) // (ex.case.prefill_ar if mode == "hybrid" else 1)
    assert r.stats.state_snapshots == blocks  # one at each full block's end


def recurrent(vlm) -> list[np.ndarray]:
    """The recurrent layers' arrays and every K/V row the cache holds."""
    c = vlm.row.cache
    return [*c.states["recurrent"].arrays, c.stored()]


def lookahead_run(ex, monkeypatch, mode: str):
    """(plain VLM after 24 greedy tokens of a text prompt, the lookahead VLM after the same, its stats): the random model
    copies nothing, so the drafter looks its drafts up in the prompt's ids followed by plain decoding's answer with
    every fourth token wrong (as tests/test_lfm2_vl.py does)."""
    from vlmrt.runtime.decode import lookahead

    monkeypatch.setattr(lookahead, "NGRAMS", (3, 2))
    monkeypatch.setattr(lookahead, "FIRST_PAUSE", 1)
    text = "Describe the colours of a sunset over the sea."
    plain, fast = VLM.load(ex.bundle), VLM.load(ex.bundle, lookahead=3)
    want = plain(text, max_new_tokens=24, ignore_eos=True, mode=mode).token_ids
    p = fast.prompt(text, [])
    vocab = fast.manifest.decoder.vocab_size
    lookup = p.ids + [(t + 1) % vocab if i % 4 == 3 else t for i, t in enumerate(want)]
    got = list(fast.scheduler.generate(fast.embed_prompt(p), mode=mode, max_new_tokens=24, ignore_eos=True,
                                       prompt_ids=lookup))
    return plain, fast, want, got, fast.scheduler.last


@pytest.mark.parametrize("mode", ["kv", "hybrid"])
def test_lookahead_rejections_replay_to_plain_state(ex, monkeypatch, mode):
    plain, fast, want, got, g = lookahead_run(ex, monkeypatch, mode)
    assert got == want and g.drafted_tokens > g.accepted_tokens > 0
    assert g.state_replays > 0 and g.replay_s > 0
    assert plain.row.cache.length == fast.row.cache.length
    for x, y in zip(recurrent(fast), recurrent(plain)):
        np.testing.assert_allclose(x, y, rtol=0, atol=2e-5)


@pytest.mark.parametrize("guard", [True, False], ids=["guarded", "unguarded"])
def test_lookahead_without_the_replay_keeps_rejected_drafts(ex, monkeypatch, guard):
    """The planted fault: CacheRow.verify told that the cache keeps a call's first rows alone (KVCache.keeps true, so
    no replay). The cache's store refuses to keep part of a step (ValueError: it asks the states themselves); with
    that guard planted out too, the rejected drafts stay in the recurrent state, which then parts from plain
    decoding's."""
    from vlmrt.runtime.decode import kv_cache

    monkeypatch.setattr(kv_cache.KVCache, "keeps", lambda self, n, ar: True)
    if not guard:
        monkeypatch.setattr(kv_cache.KVCache, "_states_keep", lambda self, n, ar: True)
    if guard:
        with pytest.raises(ValueError, match="cannot be kept in part"):
            lookahead_run(ex, monkeypatch, "hybrid")
        return
    plain, fast, want, got, g = lookahead_run(ex, monkeypatch, "hybrid")
    assert g.state_replays == 0 and g.drafted_tokens > g.accepted_tokens
    apart = max(float(np.abs(x - y).max()) for x, y in zip(recurrent(fast)[:-1], recurrent(plain)[:-1]))
    assert got != want or apart > 1e-3


BAD = [
    (lambda t: t.update(layer_types=["linear_attention", "sliding_attention", "linear_attention", "linear_attention"]),
     "text_config.layer_types[1] 'sliding_attention'"),
    (lambda t: t.update(layer_types=["linear_attention", "full_attention"]), "text_config.layer_types names 2 layers"),
    (lambda t: t.update(linear_num_value_heads=3), "text_config.linear_num_value_heads 3"),
    (lambda t: t.update(num_key_value_heads=3), "text_config.num_attention_heads 4 is not a multiple"),
    (lambda t: t["rope_parameters"].update(partial_rotary_factor=0.45), "partial_rotary_factor 0.45"),
    (lambda t: t["rope_parameters"].update(mrope_section=[2, 2, 2]), "mrope_section [2, 2, 2]"),
    (lambda t: t["rope_parameters"].update(mrope_interleaved=False), "mrope_interleaved"),
    (lambda t: t["rope_parameters"].update(rope_type="yarn", factor=2.0), "rope type 'yarn'"),
]


@pytest.mark.parametrize("edit,message", BAD, ids=[m.split()[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_unexportable_config_is_refused_in_one_line(edit, message, tmp_path, tmp_path_factory, capsys):
    from vlmrt.cli import main

    src = qwen_exported(CASES[0], tmp_path_factory).ckpt
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    edit(cfg["text_config"])
    (ckpt / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "bundle"
    rc = main(["export", str(ckpt), str(out)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("vlmrt: ")]
    assert rc == 1 and len(err) == 1 and message in err[0], err
    assert not out.exists() and not list(tmp_path.glob("bundle*"))


@pytest.fixture(scope="module")
def static(tmp_path_factory):
    """CASES[0]'s checkpoint exported with static graphs (--context-step 0: prefill AR 8, decode AR 1, the whole cache
    as I/O, the gated delta rule in plain ops, valid_rows masking a padded block), and the case's own bundle."""
    from vlmrt.export.pipeline import export

    ex = qwen_exported(CASES[0], tmp_path_factory)
    out = export(str(ex.ckpt), tmp_path_factory.mktemp("qwen3.5-static") / "bundle", progress=False,
                 prefill_ar=ex.case.prefill_ar, context_step=0, max_seq_len=512)
    return ex, out


def after_prompt(bundle, text: str, images=(), mode: str = "hybrid", leak: bool = False):
    """(the answer's 24 greedy ids, the recurrent layers' arrays right after the prompt's last block). leak: the
    padding rows marked real (valid_rows all 1), as a graph without the mask would take them."""
    from vlmrt.runtime.decode import step_features

    vlm = VLM.load(bundle)
    p = vlm.prompt(text, list(images))
    g = vlm.scheduler.generate(vlm.embed_prompt(p), mode=mode, max_new_tokens=24, ignore_eos=True)
    set_valid = step_features.ValidRows.__dict__["set"]  # (the staticmethod itself)
    if leak:
        step_features.ValidRows.set = staticmethod(lambda b: None)
    try:
        first = next(g)
    finally:
        step_features.ValidRows.set = set_valid
    state = [a.copy() for a in vlm.row.cache.states["recurrent"].arrays]
    return [first, *g], state, len(p.ids)


def test_static_graphs_keep_a_padded_block_out_of_the_state(static, tmp_path):
    """Static graphs (what --target htp builds): a text prompt whose last prefill block is padded (35 tokens in blocks
    of 8) answers transformers' 24 greedy ids in both modes, and the recurrent state and conv windows after the prompt
    are the GroupQueryAttention bundle's (LinearAttention over exactly the prompt's rows) within float rounding; the
    padding taken in (valid_rows all 1) moves the state by far more. An image prompt whose image
    the blocks cut gives the other bundle's ids."""
    import family_runner

    ex, bundle = static
    text = "Describe the colours of a sunset over the sea."
    ids, want = hf_ids(ex, text, 24)
    assert len(ids) % ex.case.prefill_ar  # the last block is padded
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["decoder"]["kind"]["name"] == "rows_static" and m["decoder"]["kind"]["valid_rows_input"] == "valid_rows"
    got, state, n = after_prompt(bundle, text)
    assert n == len(ids) and got == want and len(set(want)) > 4
    assert after_prompt(bundle, text, mode="kv")[0] == want
    _, ref, _ = after_prompt(ex.bundle, text)
    err = max(float(np.abs(a.reshape(b.shape) - b).max()) for a, b in zip(state, ref))
    assert err < 1e-5, err  # measured 1.2e-6
    _, bad, _ = after_prompt(bundle, text, leak=True)
    assert max(float(np.abs(a.reshape(b.shape) - b).max()) for a, b in zip(bad, ref)) > 100 * err
    image = family_runner.three_images(ex)[1]
    assert after_prompt(bundle, "What is in the image?", [image])[0] == after_prompt(ex.bundle, "What is in the image?",
                                                                                      [image])[0]
