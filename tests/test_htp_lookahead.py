"""Lookahead decoding on the HTP target (`vlmrt export --target htp --lookahead-ar K`): the static verify graph
(the decode graph at AR = K with decode's quantization, export/htp/verify.py) on the session's HTP bundle of the
tiny SmolVLM fixture (test_quant.bundle("htp"), AR 5): the manifest entry, its encodings equal to decode's, greedy
lookahead ids equal to plain decoding on the CPU EP (the QDQ graphs), rejected drafts' rows never in the cache, the
context binary on the HTP simulator (a verify row against decode steps there), and a bad K refused in one line.
The InternVL (Qwen2) fixture's HTP bundle is checked in test_internvl.py (test_htp_context_binaries_qwen2_biases).

The random fixture copies nothing by itself (its answers repeat no n-gram: prompt lookup drafts a few tokens and none
is accepted), so acceptance is exercised by drafting from an oracle: the plain answer with two tokens changed, given
to the drafter as the ids it looks up (drafting only decides what is verified, never the answer)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from conftest import image_file, on_npu
from test_errors import assert_one_line_error, in_process
from test_quant import bundle
from vlmrt.format import manifest as mf
from vlmrt.runtime.decode.kv_cache import attention_mask
from vlmrt.runtime.vlm import VLM

pytest.importorskip("torch")
pytest.importorskip("onnxruntime_qnn")

PROMPTS = [("Repeat this list exactly: apple, banana, cherry, apple, banana.", None),
           ("Copy: red green blue, red green blue, red green blue", None),
           ("What is in the image?", "chelsea.png")]


def oracle(answer: list[int], vocab: int) -> list[int]:
    """The plain answer with its 7th and 14th tokens changed: drafts from it are accepted up to a changed token."""
    out = list(answer)
    for i in (6, 13):
        out[i] = (out[i] + 1) % vocab
    return out


def lookahead_runs(b, device: str, prompts, modes, tokens: int = 24):
    """(plain ids, lookahead ids, lookahead stats, plain cache rows, lookahead cache rows, rows beyond the length
    written, gap) per prompt and mode, with the oracle drafter and with prompt lookup itself; gap: how far below
    plain decoding's best logit (teacher-forced on the lookahead ids) the emitted tokens' logits fall, at most."""
    plain, fast = VLM.load(b, device=device), VLM.load(b, device=device, lookahead=4)
    vocab = plain.manifest.decoder.vocab_size
    for prompt, image in prompts:
        ids, embeds = plain.prompt_embeds(prompt, image_file(image, None) if image else None)
        for mode in modes:
            a = list(plain.scheduler.generate(embeds, mode=mode, max_new_tokens=tokens, ignore_eos=True))
            for drafts_from in (oracle(a, vocab) + list(ids), list(ids)):
                got = list(fast.scheduler.generate(embeds, mode=mode, max_new_tokens=tokens, ignore_eos=True,
                                                prompt_ids=drafts_from))
                c, enc = fast.row.cache, fast.row.kv_spec.encodings["decode"]
                # the slots past the length hold decode's zero (KVCache.clear_unused: byte zp), never a row (a write
                # to cache.data from here would break its "clean from" mark: the engine alone writes the cache)
                st, rows, beyond = fast.scheduler.last, c.stored().astype(int), any(
                    (c.data[i, j, c.length:] != enc[kind][i][1]).any()
                    for i in range(len(c.spec.layers)) for j, kind in enumerate(("key", "value")))
                gap = 0.0
                if got != a:
                    scores = plain.row.score(embeds, got, mode=mode)
                    gap = max(float(sc.max() - sc[t]) for sc, t in zip(scores, got))
                    list(plain.scheduler.generate(embeds, mode=mode, max_new_tokens=tokens, ignore_eos=True))
                yield a, got, st, plain.row.cache.stored().astype(int), rows, beyond, gap


def test_verify_graph_in_the_manifest_with_decodes_quantization(tmp_path_factory):
    b = bundle("htp", tmp_path_factory)
    m = mf.load(b)
    v, d = m.graphs["verify"], m.graphs["decode"]
    assert m.decoder.kind.verify_ar == 5 and v.precision == d.precision and v.context.file == "verify_ctx.onnx"
    assert v.input("inputs_embeds").shape == [5, m.decoder.hidden_size]
    assert v.input("attention_mask").shape == [5, m.kv.max_context + 5] and v.input("past_key_0").dtype == "uint8"
    assert v.output("logits").shape == [5, m.decoder.vocab_size] and v.output("new_key_1").shape == [5, m.kv.layers[1].dim]
    assert m.kv.encodings["verify"] == m.kv.encodings["decode"]  # it reads and writes decode's cache
    assert v.data_files == d.data_files == ["decoder.data"]  # the weights stored once for the three graphs
    # every Q/DQ node of the verify graph has decode's scale, zero point and constant (htp_verify.copy_encodings)
    gv, gd = (onnx.load(str(b / g.file)) for g in (v, d))
    iv, id_ = ({i.name: onnx.numpy_helper.to_array(i) for i in g.graph.initializer} for g in (gv, gd))
    qdq = [(x, y) for x, y in zip(gv.graph.node, gd.graph.node) if x.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert len(qdq) > 100 and [n.op_type for n in gv.graph.node] == [n.op_type for n in gd.graph.node]
    for x, y in qdq:
        for a, c in zip(x.input[1:], y.input[1:]):
            np.testing.assert_array_equal(iv[a], id_[c])


def logits_step(b) -> float:
    """One step of the decode graph's 16-bit logits encoding: the scale of the DequantizeLinear giving its logits."""
    g = onnx.load(str(Path(b) / mf.load(b).graphs["decode"].file), load_external_data=False).graph
    node = next(n for n in g.node if "logits" in n.output)
    consts = {i.name: i for i in g.initializer}
    consts |= {n.output[0]: n.attribute[0].t for n in g.node if n.op_type == "Constant"}
    return float(onnx.numpy_helper.to_array(consts[node.input[1]]))


def assert_as_plain(run, step: float) -> bool:
    """A lookahead_runs run on the CPU EP (the QDQ graphs): greedy lookahead ids equal plain decoding's, or part from
    them at a tie within one step of the logits' 16-bit encoding only (the emitted token's plain-decoding logit at most
    one step below the best: a verify row's logits are within one step of sequential decode steps' (the verify graph
    is another graph: a 5-row call), so at a top-2 margin that small either token can come first; measured: none of
    12 runs parts with a bundle exported and run on AVX-512 VNNI CPUs, 1 of 12 at its 22nd token, one step apart,
    exported and run with AVX2 only (benchmarks/avx2-only); the rows before a parting within 1 uint8 step of a plain
    run's (rows of a 5-row call; measured max 1; 2 before the graphs attended to their own rows as stored); no
    rejected draft's row in the cache. Returns whether the ids are equal."""
    a, got, st, pc, fc, beyond, gap = run
    assert not beyond, "a rejected draft's row is in the cache"
    part = next((i for i, (x, y) in enumerate(zip(a, got)) if x != y), len(a))
    same = pc.shape[2] - (len(a) - 1) + part  # the prompt's rows and those of the answer's tokens before the parting
    assert pc.shape == fc.shape and np.abs(pc[:, :, :same] - fc[:, :, :same]).max() <= 1
    assert gap <= step * 1.001, (part, gap, step)
    return got == a


def test_lookahead_equals_plain_on_the_cpu_ep(tmp_path_factory):
    """The QDQ graphs on the CPU EP: greedy lookahead ids are plain decoding's (assert_as_plain: or part from them at a
    tie within one logits step), kv and hybrid mode; drafts are accepted (oracle) and rejected; the cache holds the
    rows of the emitted tokens only."""
    b = bundle("htp", tmp_path_factory)
    drafted = accepted = 0
    for run in lookahead_runs(b, "cpu", PROMPTS, ("kv", "hybrid")):
        assert_as_plain(run, logits_step(b))
        st = run[2]
        drafted, accepted = drafted + st.drafted_tokens, accepted + st.accepted_tokens
    assert accepted >= 40 and drafted > accepted  # measured: 80 of 84 drafted tokens accepted


def test_verify_graph_on_the_htp_simulator(tmp_path_factory):
    """--device htp: the verify context binary runs on the NPU (CPU fallback off). A verify call over 5 tokens: row 0
    is a decode step (logits bit for bit, measured), rows 1-4 within 0.15 of 4 sequential decode steps (measured max
    0.11, logits ~3.3: the HTP computes a 5-row call slightly differently from a 1-row call, its new K/V one uint8
    step apart), and a lookahead run emits at each step a token within that gap of plain decoding's best (measured:
    3 of 4 runs plain decoding's ids, one parting at a top-2 margin of 0.013, a near-tie of this random fixture)."""
    b = bundle("htp", tmp_path_factory)
    npu = VLM.load(b, device="htp", lookahead=4)
    on_npu(npu)
    assert npu.bundle.sessions.loaded("verify") and npu.bundle.sessions["verify"]._model_path.endswith("verify_ctx.onnx")
    m, e = npu.manifest, npu.row
    ids, embeds = npu.prompt_embeds(PROMPTS[0][0], None)
    e.prefill(embeds, "hybrid")
    pos, ctx, toks = e.cache.length, m.kv.max_context, e.embed([5, 6, 7, 8, 9])

    def call(graph, rows, at):
        s = npu.bundle.sessions[graph]
        f = {**e.cache.feeds(ctx), "inputs_embeds": rows, "position_ids": at + np.arange(len(rows))[None],
             "attention_mask": attention_mask(at, len(rows), ctx, np.float32, neg=m.decoder.kind.mask_value)}
        return dict(zip([o.name for o in s.get_outputs()], s.run(None, f)))

    verify = call("verify", toks, pos)
    for i in range(5):  # sequential decode steps, their rows written as the engine writes them
        one = call("decode", toks[i : i + 1], pos + i)
        gap = np.abs(one["logits"][0] - verify["logits"][i]).max()
        assert gap == 0 if i == 0 else gap < 0.15, (i, gap)
        e.cache.store([np.stack([np.stack([one[f"new_key_{j}"], one[f"new_value_{j}"]]) for j in range(len(m.kv.layers))])],
                      1, np.array([[pos + i]]))
    plain = VLM.load(b, device="htp")
    got = list(npu.scheduler.generate(embeds, mode="hybrid", max_new_tokens=16, ignore_eos=True,
                          prompt_ids=oracle(list(plain.scheduler.generate(embeds, mode="hybrid", max_new_tokens=16,
                                                                       ignore_eos=True)), m.decoder.vocab_size) + ids))
    assert npu.scheduler.last.accepted_tokens > 0
    scores = plain.row.score(embeds, got, mode="hybrid")  # plain decoding's logits after each prefix of got
    assert all(s.max() - s[t] < 0.15 for s, t in zip(scores, got))


def test_lookahead_over_the_verify_graph_refused_in_one_line(tmp_path_factory, capsys, tmp_path):
    b = bundle("htp", tmp_path_factory)
    assert_one_line_error(in_process(capsys, "run", b, "--prompt", "hi", "--lookahead", "5"),
                          "--lookahead is at most 4 for this bundle (its verify graph's AR is 5)")
    assert_one_line_error(in_process(capsys, "run", bundle("htp-w4", tmp_path_factory), "--prompt", "hi", "--lookahead", "2"),
                          "cannot verify lookahead drafts (no verify graph)", "--lookahead-ar K")
    ckpt = tmp_path / "none"  # the options are checked before the checkpoint is read
    for args, needle in ((["--lookahead-ar", "4"], "are for --target htp"),
                         (["--target", "htp", "--lookahead-ar", "1"], "at least 2"),
                         (["--target", "htp", "--lookahead-ar", "5", "--quant", "prefill=w8a16,decode=w8a16,head=w8a16"],
                          "--lookahead-ar and --quant head=... exclude each other")):
        assert_one_line_error(in_process(capsys, "export", ckpt, tmp_path / "out", *args), needle)
