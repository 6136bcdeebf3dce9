"""Conversations (issue 15): several images per prompt, images by URL / data URI, multi-turn chat with a prefix cache
and an image embedding cache, stop strings, `vlmrt run --messages`, `vlmrt chat` — against transformers'
processor + apply_chat_template + generate on the same weights, both families, both modes."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

import test_internvl as ivl
from conftest import CASES, exported, image_file
from http_images import serve_images
from vlmrt import cli
from vlmrt.cli.options import stats_report
from vlmrt.runtime.media import image as img_ops
from vlmrt.runtime.vlm import VLM

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


SIZES = {"square": (30, 30), "strip": (60, 300), "longstrip": (40, 360), "tallstrip": (300, 60)}  # (h, w)


def small(kind: str, tmp) -> str:
    """Images of other sizes: 'square' is one untiled tile for InternVL; strips are a few SmolVLM tiles."""
    p = tmp / f"{kind}.png"
    if not p.exists():
        rng = np.random.default_rng(sorted(SIZES).index(kind))
        Image.fromarray(rng.integers(0, 256, (*SIZES[kind], 3)).astype(np.uint8)).save(p)
    return str(p)


def images_for(fam: str, n: int, tmp) -> list[str]:
    """2 or 3 images of different sizes that fit the fixtures' contexts (SmolVLM upscales every image to its longest
    edge: a square is a full grid there, so its sets are strips)."""
    kinds = {("smolvlm", 2): ["chelsea", "strip"], ("smolvlm", 3): ["strip", "longstrip", "tallstrip"],
             ("internvl", 2): ["chelsea", "square"], ("internvl", 3): ["strip", "square", "tall"]}[fam, n]
    return [str(image_file(k + ".png", None)) if k == "chelsea" else str(image_file(k, tmp)) if k == "tall"
            else small(k, tmp) for k in kinds]


def oai(images: list[str], text: str) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": p}} for p in images]
            + [{"type": "text", "text": text}]}


def hf_messages(messages: list[dict]) -> tuple[list[dict], list[str]]:
    """OpenAI-style messages -> transformers' content parts ({"type": "image"}), and the image paths in order."""
    out, paths = [], []
    for m in messages:
        c = m["content"]
        parts = [{"type": "text", "text": c}] if isinstance(c, str) else []
        for p in ([] if isinstance(c, str) else c):
            if p["type"] == "image_url":
                paths.append(p["image_url"]["url"])
                parts.append({"type": "image"})
            else:
                parts.append(p)
        out.append({"role": m["role"], "content": parts})
    return out, paths


def hf_inputs(proc, messages, nested: bool):
    hm, paths = hf_messages(messages)
    text = proc.apply_chat_template(hm, add_generation_prompt=True, tokenize=False)
    ims = [Image.open(p) for p in paths]
    if not ims:
        return proc(text=[text], return_tensors="pt")
    return proc(text=[text], images=[ims] if nested else ims, return_tensors="pt")


def hf_greedy(model, inputs, n: int) -> list[int]:
    from oracle import greedy_new_ids

    return greedy_new_ids(model, inputs, n, ignore_eos=True)


FAMILIES = [("smolvlm", c) for c in CASES] + [("internvl", c) for c in ivl.CASES]


def family_case(request, tmp_path_factory):
    fam, case = request.param
    if fam == "smolvlm":
        ex = exported(case, tmp_path_factory)
        model, proc = ex.hf()
        return ex.bundle, model, proc, True, fam
    ex = ivl.exported(case, tmp_path_factory)
    model, proc = ex.hf()
    return ex.bundle, model, proc, False, fam


@pytest.fixture(params=FAMILIES, ids=[f"{f}-{c.name}" for f, c in FAMILIES])
def family(request, tmp_path_factory):
    return family_case(request, tmp_path_factory)


def chat_ids(vlm, messages, mode, n, **kw):
    for _ in vlm.chat(messages, mode=mode, max_new_tokens=n, ignore_eos=True, **kw):
        pass
    return vlm.result


# --- 1. several images per prompt ------------------------------------------------------------------------------
@pytest.mark.parametrize("n_images", [2, 3])
def test_multi_image_prompt_and_greedy_ids_equal_transformers(family, n_images, tmp_path, capsys):
    bundle, model, proc, nested, fam = family
    paths = images_for(fam, n_images, tmp_path)
    prompt = "What changed between these pictures?"
    inputs = hf_inputs(proc, [oai(paths, prompt)], nested)
    want_prompt = inputs["input_ids"][0].tolist()
    want = hf_greedy(model, inputs, 16)
    assert len(set(want)) > 3
    for mode in ("kv", "hybrid"):
        args = ["run", str(bundle), "--prompt", prompt, "--mode", mode, "--max-new-tokens", "16", "--ignore-eos", "--json"]
        for p in paths:
            args += ["--image", p]
        capsys.readouterr()
        assert cli.main(args) == 0
        got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert got["prompt_tokens"] == len(want_prompt)
        assert got["token_ids"] == want, mode
        assert got["stats"]["images"] == n_images
    vlm = VLM.load(bundle)
    r = chat_ids(vlm, [oai(paths, prompt)], "hybrid", 1)
    assert r.prompt_ids == want_prompt


# --- 3. conversations: prompt ids of 2-3 turns equal apply_chat_template + processor ---------------------------
def conversations(fam, tmp) -> list[list[dict]]:
    a, b, c = images_for(fam, 3, tmp)
    sys_msg = {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    return [
        [oai([a], "What is this?"), {"role": "assistant", "content": "A cat."}, oai([], "Its colour?")],
        [sys_msg, oai([a], "Describe it."), {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
         oai([b], "And this?")],
        [sys_msg, oai([], "Hi."), {"role": "assistant", "content": "Hi!"}, oai([a, c], "Here."),
         {"role": "assistant", "content": "Two."}, oai([], "Which is smaller?")],
    ]


@pytest.mark.parametrize("i", range(3), ids=["2-turns", "system-2-turns-2-images", "3-turns-2-images-in-one"])
def test_conversation_prompt_ids_equal_transformers(family, i, tmp_path):
    """Prompt ids of each conversation equal transformers', and its greedy ids too: 8 tokens, or as many as the
    fixture's context leaves room for; a conversation longer than the context is refused in one line (the small
    96-token fixture's byte-level tokenizer), which is then what is checked."""
    bundle, model, proc, nested, fam = family
    vlm = VLM.load(bundle)
    conv = conversations(fam, tmp_path)[i]
    inputs = hf_inputs(proc, conv, nested)
    want_prompt = inputs["input_ids"][0].tolist()
    room = vlm.manifest.kv.max_context - len(want_prompt)
    if room < 1:
        with pytest.raises(ValueError, match="max context") as e:  # ContextOverflow
            chat_ids(vlm, conv, "hybrid", 8)
        assert "\n" not in str(e.value)
        assert vlm.result.prompt_ids == want_prompt
        return
    n = min(8, room)
    r = chat_ids(vlm, conv, "hybrid", n)
    assert r.prompt_ids == want_prompt
    assert r.token_ids == hf_greedy(model, inputs, n)


def test_string_content_template_multi_image_turns(tmp_path_factory, tmp_path):
    """OpenGVLab's original layout: its template takes string content only; each image is written into the text as
    "<image>\n" (model.chat()) and expanded. Greedy ids equal transformers' on the -hf checkpoint for those ids."""
    from fixtures_internvl import to_original_layout

    from vlmrt.export.pipeline import export

    case = ivl.CASES[0]
    ex = ivl.exported(case, tmp_path_factory)
    b = export(str(to_original_layout(ex.ckpt, tmp_path / "orig")), tmp_path / "b", prefill_ar=case.prefill_ar,
               progress=False)
    vlm = VLM.load(b)
    assert vlm.manifest.prompt.content_format == "string"
    a, c = images_for("internvl", 2, tmp_path)
    conv = [oai([a], "Describe it."), {"role": "assistant", "content": "A cat."}, oai([c, a], "Compare.")]
    r = chat_ids(vlm, conv, "hybrid", 12)
    text = vlm.bundle.tokenizer.decode(r.prompt_ids, skip_special_tokens=False)
    assert text.count("<img>") == 3 and "</img>\nDescribe it.<|im_end|>" in text and "</img>\nCompare." in text
    pixels = np.concatenate([img_ops.preprocess(img_ops.load_image(p), vlm.manifest.image).pixels for p in (a, c, a)])
    assert r.token_ids == ivl.hf_greedy_from_ids(ex.hf()[0], r.prompt_ids, pixels, 12)


# --- 4. the prefix cache: same answers as a fresh run, fewer tokens prefilled, vision skipped ------------------
def follow_ups(tmp):
    a, b = images_for("smolvlm", 2, tmp)
    t1 = [oai([a], "Describe the picture.")]
    return t1, lambda ans1: t1 + [{"role": "assistant", "content": ans1}, oai([], "What colour is it?")], b


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-sampling"])
@pytest.mark.parametrize("mode", ["kv", "hybrid"])
@pytest.mark.parametrize("which", ["smolvlm", "internvl"])
def test_chat_reuse_equals_fresh_run(which, mode, sampled, tmp_path_factory, tmp_path):
    bundle = exported(CASES[0], tmp_path_factory).bundle if which == "smolvlm" else \
        ivl.exported(ivl.CASES[0], tmp_path_factory).bundle
    opts = dict(mode=mode, max_new_tokens=12, **(dict(temperature=1.0, top_k=20, top_p=0.9, seed=7) if sampled else {}))
    vlm = VLM.load(bundle)
    t1, t2_of, b = follow_ups(tmp_path)
    ans1 = "".join(vlm.chat(t1, **opts))
    assert vlm.result.stats.reused_prompt_tokens == 0 and not vlm.result.stats.vision_skipped
    turns = [t2_of(ans1)]
    turns.append(turns[0] + [{"role": "assistant", "content": "Grey."}, oai([b], "Compare with this one.")])
    for conv, cached_images, skipped in zip(turns, (1, 1), (True, False)):
        got = "".join(vlm.chat(conv, **opts))
        r = vlm.result
        fresh = VLM(vlm.bundle)  # no caches: the same sessions, a new engine
        want = "".join(fresh.chat(conv, **opts))
        assert fresh.result.stats.reused_prompt_tokens == 0
        assert r.token_ids == fresh.result.token_ids and got == want
        assert r.prompt_ids == fresh.result.prompt_ids
        assert 0 < r.stats.reused_prompt_tokens < len(r.prompt_ids)
        # the follow-up on the same image skipped the vision graph; the last turn encoded only the new image
        assert r.stats.images_cached == cached_images and r.stats.vision_skipped == skipped


@pytest.mark.parametrize("mode", ["kv", "hybrid"])
def test_resumed_prefill_is_bitwise_a_fresh_one(default_bundle, mode, tmp_path):
    """The rows kept by CacheRow.reusable are those a fresh prefill computes: the resumed prefill's logits are equal
    bit for bit (hybrid mode keeps only full AR blocks; resuming elsewhere is refused)."""
    vlm = VLM.load(default_bundle.bundle)
    ids, embeds = vlm.prompt_embeds("Describe the picture in detail, please.", image_file("chelsea.png", None))
    e, n = vlm.row, len(ids)
    fresh = e.prefill(embeds, mode).copy()
    for cut in (n - 20, n - 9):
        e.prefill(embeds[:cut], mode)
        s = e.reusable(mode, cut)
        ar = default_bundle.case.prefill_ar if mode == "hybrid" else 1
        assert s > 0 and np.array_equal(e.prefill(embeds[s:], mode, start=s), fresh)
        assert s == cut - cut % ar
    if mode == "hybrid":
        e.prefill(embeds[: n - 9], mode)
        bad = e.reusable(mode, n - 9) + 1
        with pytest.raises(ValueError, match="cannot resume"):
            e.prefill(embeds[bad:], mode, start=bad)


def test_another_image_of_the_same_size_is_not_reused(default_bundle, tmp_path):
    """Image rows are keyed by the image's content: the same prompt ids with another picture keep only the rows before
    the first image token, and the vision graph runs again."""
    vlm = VLM.load(default_bundle.bundle)
    a = small("strip", tmp_path)
    b = tmp_path / "strip-other.png"
    Image.fromarray(np.random.default_rng(99).integers(0, 256, (*SIZES["strip"], 3)).astype(np.uint8)).save(b)
    chat_ids(vlm, [oai([a], "Describe it.")], "kv", 4)
    r = chat_ids(vlm, [oai([str(b)], "Describe it.")], "kv", 4)
    first_image = r.prompt_ids.index(vlm.manifest.special_tokens.image_token_id)
    assert r.stats.reused_prompt_tokens == first_image and not r.stats.vision_skipped
    assert r.token_ids == chat_ids(VLM(vlm.bundle), [oai([str(b)], "Describe it.")], "kv", 4).token_ids


def test_generate_between_chats_invalidates_the_prefix(default_bundle, tmp_path):
    vlm = VLM.load(default_bundle.bundle)
    t1, t2_of, _ = follow_ups(tmp_path)
    ans = "".join(vlm.chat(t1, max_new_tokens=6))
    vlm("Something else entirely.", max_new_tokens=3)  # overwrites the cache's rows
    conv = t2_of(ans)
    got = "".join(vlm.chat(conv, max_new_tokens=8))
    assert vlm.result.stats.reused_prompt_tokens == 0 and vlm.result.stats.vision_skipped  # embeddings still cached
    assert got == "".join(VLM(vlm.bundle).chat(conv, max_new_tokens=8))


def test_a_call_that_prefills_nothing_keeps_the_prefix_truthful(default_bundle, tmp_path):
    """A call refused before its prefill leaves the cache's rows as they were; the next turn still answers as a
    fresh run does (max_new_tokens=0 used to record the new prompt's keys over the old rows)."""
    vlm = VLM.load(default_bundle.bundle)
    t1, _, b = follow_ups(tmp_path)
    "".join(vlm.chat(t1, max_new_tokens=6, mode="kv"))
    other = [oai([b], "Describe the picture.")]
    with pytest.raises(ValueError, match="max_new_tokens"):
        list(vlm.chat(other, max_new_tokens=0, mode="kv"))
    conv = other + [{"role": "assistant", "content": "A strip."}, oai([], "Its colour?")]
    got = "".join(vlm.chat(conv, max_new_tokens=8, mode="kv"))
    assert vlm.result.stats.reused_prompt_tokens < len(vlm.result.prompt_ids) // 2  # the rows hold t1, not `other`
    assert got == "".join(VLM(vlm.bundle).chat(conv, max_new_tokens=8, mode="kv"))


def test_image_cache_is_bounded(default_bundle, tmp_path):
    one = VLM.load(default_bundle.bundle)
    r = chat_ids(one, [oai([str(image_file("chelsea.png", None))], "Hi")], "hybrid", 1)
    size = one.image_cache.bytes
    assert size > 0 and r.stats.images == 1
    vlm = VLM.load(default_bundle.bundle, image_cache_bytes=int(size * 1.5))
    a, b, c = images_for("smolvlm", 3, tmp_path)
    for p in (a, b, c, a):
        chat_ids(vlm, [oai([p], "Hi")], "hybrid", 1)
        assert vlm.image_cache.bytes <= vlm.image_cache.max_bytes
    assert vlm.result.stats.images_cached == 0  # a was dropped to make room for b and c
    chat_ids(vlm, [oai([a], "Hi again")], "hybrid", 1)
    assert vlm.result.stats.images_cached == 1 and vlm.result.stats.vision_skipped


# --- 2. image sources ----------------------------------------------------------------------------------------------
def test_an_image_is_one_record_from_its_tiles_to_the_image_cache(default_bundle):
    """An image read for a prompt is one ImageChunk: placed in the prompt (its ids those of its slots), given its rows
    by the vision graph (its pixels dropped then), and kept as it is by the image cache, which a later turn's hit
    reuses. Guards the fold of Media into ImageChunk (on 6bf0bd2 the cache kept a CachedImage copy and the chunk its
    pixels)."""
    vlm = VLM.load(default_bundle.bundle)
    path = str(image_file("chelsea.png", None))
    p = vlm.prompt("Hi", [path])
    (o, c), = p.images()
    assert c.pixels is not None and c.embeds is None and p.ids[o:o + c.n_tokens] == c.ids and c.label == "image 1"
    vlm.embed_prompt(p, cache=True)
    assert vlm.image_cache.get(c.key) is c and c.pixels is None and c.embeds.shape[0] == len(c.rows)
    assert vlm.image_cache.bytes == c.embeds.nbytes


def test_images_by_url_and_data_uri_equal_the_file(default_bundle, tmp_path):
    path = image_file("chelsea.png", None)
    raw = path.read_bytes()
    uri = "data:image/png;base64," + base64.b64encode(raw).decode()
    vlm = VLM.load(default_bundle.bundle)
    want = chat_ids(vlm, [oai([str(path)], "What is it?")], "hybrid", 8).token_ids
    with serve_images({"/cat.png": raw, "/moved": ("redirect", "/cat.png")}) as url:
        for src in (url + "/cat.png", url + "/moved", uri):
            fresh = VLM(vlm.bundle)
            assert chat_ids(fresh, [oai([src], "What is it?")], "hybrid", 8).token_ids == want, src
        # the same bytes from another source are the same image to the embedding cache
        chat_ids(vlm, [oai([url + "/cat.png"], "What is it?")], "hybrid", 8)
        assert vlm.result.stats.vision_skipped


def one_error_line(capsys, *args) -> str:
    capsys.readouterr()
    rc = cli.main(list(map(str, args)))
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("vlmrt: error: "), captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    return lines[0]


def test_bad_image_sources_give_one_error_line(default_bundle, capsys, tmp_path):
    import socket

    b = default_bundle.bundle
    run = ["run", b, "--prompt", "Hi", "--max-new-tokens", 2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/x.png"
    assert closed in one_error_line(capsys, *run, "--image", closed)
    assert "bad base64" in one_error_line(capsys, *run, "--image", "data:image/png;base64,@@not base64@@")
    assert "data URI" in one_error_line(capsys, *run, "--image", "data:text/plain;base64,aGk=")
    assert "ftp://" in one_error_line(capsys, *run, "--image", "ftp://127.0.0.1/x.png")
    with serve_images({"/text": b"hello, not an image", "/loop": ("redirect", "/loop"),
                       "/big": b"\x89PNG" + bytes(4096), "/slow": ("sleep", 5.0)}) as url:
        for path, words in (("/text", "cannot read image"), ("/loop", "redirects"), ("/missing", "HTTP 404"),
                            ("/big", "byte limit")):
            line = one_error_line(capsys, *run, "--image", url + path) if path != "/big" else None
            if path == "/big":  # the byte cap, set small for the test through the Python API
                from vlmrt.runtime.media.sources import FetchLimits

                vlm = VLM.load(b, fetch=FetchLimits(max_bytes=1000))
                with pytest.raises(img_ops.ImageError, match="byte limit"):
                    list(vlm.chat([oai([url + path], "Hi")], max_new_tokens=1))
                continue
            assert words in line and url + path in line, line
        from vlmrt.runtime.media.sources import FetchLimits

        vlm = VLM.load(b, fetch=FetchLimits(timeout_s=0.5))
        with pytest.raises(img_ops.ImageError, match="timed out"):
            list(vlm.chat([oai([url + "/slow"], "Hi")], max_new_tokens=1))


def test_a_url_that_drips_its_bytes_is_cut_off_at_the_deadline(default_bundle):
    """Every read arrives within the read timeout, but the whole fetch may not take longer than total_s (a server
    could hold a request, or `vlmrt serve`'s image threads, for as long as it dripped)."""
    from vlmrt.runtime.media.sources import FetchLimits

    vlm = VLM.load(default_bundle.bundle, fetch=FetchLimits(timeout_s=0.5, total_s=1.0))
    with serve_images({"/drip": ("drip", 0.1, 100)}) as url:
        # (the drip takes 10 s; had it not been cut off, its 100 bytes would be refused as not an image instead)
        with pytest.raises(img_ops.ImageError, match="not received within 1 s"):
            list(vlm.chat([oai([url + "/drip"], "Hi")], max_new_tokens=1))


def test_too_many_images_for_the_context_is_one_line(capsys, tmp_path_factory, tmp_path):
    ex = exported(CASES[1], tmp_path_factory)  # untiled, max context 96
    many = [str(image_file("chelsea.png", None))] * 12
    line = one_error_line(capsys, "run", ex.bundle, *[x for p in many for x in ("--image", p)], "--prompt", "Hi")
    assert "12 images" in line and "tiles per image" in line and "--max-seq-len" in line and "fewer images" in line


# --- run --messages, stop strings, chat REPL ---------------------------------------------------------------------
def test_run_messages_file_equals_api(default_bundle, capsys, tmp_path):
    conv = conversations("smolvlm", tmp_path)[1]
    f = tmp_path / "conv.json"
    f.write_text(json.dumps(conv))
    capsys.readouterr()
    assert cli.main(["run", str(default_bundle.bundle), "--messages", str(f), "--max-new-tokens", "8", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    vlm = VLM.load(default_bundle.bundle)
    text = "".join(vlm.chat(conv, max_new_tokens=8))
    assert got["token_ids"] == vlm.result.token_ids and got["text"] == text
    f.write_bytes(b"\xef\xbb\xbf" + json.dumps(conv).encode())  # a UTF-8 BOM, as Windows editors and PowerShell write
    assert cli.main(["run", str(default_bundle.bundle), "--messages", str(f), "--max-new-tokens", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"] == got["token_ids"]
    f.write_text("[{\"role\": \"user\"")
    assert "not JSON" in one_error_line(capsys, "run", default_bundle.bundle, "--messages", f)
    f.write_text(json.dumps([{"role": "assistant", "content": "Hi"}]))
    assert "last message" in one_error_line(capsys, "run", default_bundle.bundle, "--messages", f)
    f.write_text(json.dumps([{"role": "user", "content": [{"type": "audio"}]}]))
    assert "type must be" in one_error_line(capsys, "run", default_bundle.bundle, "--messages", f)


def test_stop_strings_cut_the_answer_and_end_generation(default_bundle):
    vlm = VLM.load(default_bundle.bundle)
    msgs = [oai([str(image_file("chelsea.png", None))], "Describe it.")]
    full = "".join(vlm.chat(msgs, max_new_tokens=24, ignore_eos=True))
    ids = vlm.result.token_ids
    assert len(full) > 12
    stop = full[6:9]
    at = full.index(stop)
    pieces = list(vlm.chat(msgs, max_new_tokens=24, ignore_eos=True, stop=["\x00never", stop]))
    r = vlm.result
    assert "".join(pieces) == r.text == full[:at]
    assert r.stats.stop_reason == "stop" and len(r.token_ids) < len(ids) and r.token_ids == ids[: len(r.token_ids)]
    # the text up to the stop string is all the tokens needed to write it: generation ended at the stop
    assert stop in vlm.bundle.tokenizer.decode(r.token_ids, skip_special_tokens=True)
    assert stop not in vlm.bundle.tokenizer.decode(r.token_ids[:-1], skip_special_tokens=True)


def test_stop_strings_held_back_across_pieces():
    from vlmrt.runtime.prompt.stop_strings import StopStrings

    cut = StopStrings(["END", "xyz"])
    out = [cut.feed(p) for p in ("ab", "cE", "N", "Dfoo")]
    assert out == ["ab", "c", "", ""] and cut.stopped and cut.text == "abc"
    cut = StopStrings(["END"])
    assert [cut.feed(p) for p in ("aE", "Nb")] + [cut.flush()] == ["a", "ENb", ""] and not cut.stopped
    with pytest.raises(ValueError):
        StopStrings([""])


def test_chat_repl(default_bundle, tmp_path):
    from vlmrt.chat_repl import repl

    a = str(image_file("chelsea.png", None))
    vlm = VLM.load(default_bundle.bundle)
    out, err = io.StringIO(), io.StringIO()
    script = f"What is this?\n/image {small('strip', tmp_path)}\nAnd this one?\n/stats\n/image /no/such.png\nHm?\n/reset\nHi\n"
    assert repl(vlm, dict(max_new_tokens=4), images=[a], report=stats_report, stdin=io.StringIO(script),
                stdout=out, stderr=err) == 0
    log = err.getvalue()
    turns = [ln for ln in log.splitlines() if ln.startswith("[") and "prompt tokens" in ln]
    assert len(turns) == 3, log
    assert " 0 reused" in turns[0] and " 0 reused" not in turns[1]  # the second turn kept the first's rows
    assert "vlmrt: error: image not found: /no/such.png" in log and "time to 1st token" in log
    assert len([ln for ln in out.getvalue().splitlines()]) == 3  # one answer line per answered turn


def test_an_answer_overtaken_by_another_on_the_same_vlm(default_bundle):
    """Two answers alive on one VLM share its KV cache: the older one, resumed, raises instead of stepping on the
    other's rows, and, closed late (garbage collected), records nothing in the prefix cache (it recorded its own
    conversation over the rows the newer answer had written, which a later turn then reused: a wrong answer)."""
    vlm = VLM.load(default_bundle.bundle)
    first = [{"role": "user", "content": "Tell me about red apples and green pears, please."}]
    other = [{"role": "user", "content": "Count the blue boxes on the table below the window."}]
    g = vlm.chat(first, max_new_tokens=20, ignore_eos=True)
    next(g)
    "".join(vlm.chat(other, max_new_tokens=4))
    with pytest.raises(RuntimeError, match="the VLM began another one"):
        list(g)
    g = vlm.chat(first, max_new_tokens=20, ignore_eos=True)
    next(g)
    "".join(vlm.chat(other, max_new_tokens=4))
    del g  # closed now, after the other answer
    follow = first + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "And more?"}]
    assert "".join(vlm.chat(follow, max_new_tokens=8)) == direct_answer(vlm.bundle, follow)


def test_max_new_tokens_of_the_wrong_type_is_named(default_bundle):
    """2.5 ran (the engine's loop compared floats), '3' and None were a bare '<' TypeError."""
    vlm = VLM.load(default_bundle.bundle)
    for bad in (2.5, "3", None, True):
        with pytest.raises(TypeError, match=f"max_new_tokens must be an integer, not {type(bad).__name__}"):
            list(vlm.chat([{"role": "user", "content": "hi"}], max_new_tokens=bad))
    assert vlm("hi", max_new_tokens=np.int64(2)).stats.generated_tokens == 2


def direct_answer(bundle, messages) -> str:
    return "".join(VLM(bundle).chat(messages, max_new_tokens=8))


def test_chat_repl_without_a_turn(default_bundle, monkeypatch):
    """/stats before any answered turn (and after a failed one) says so (was a report of zeros, 'stop: '); a closed
    standard input (`vlmrt chat <&-`: sys.stdin is None) is an empty input (was an AttributeError traceback)."""
    from vlmrt.chat_repl import repl

    vlm = VLM.load(default_bundle.bundle)
    err = io.StringIO()
    script = io.StringIO("/stats\n/image /no/such.png\nHi\n/stats\n")
    assert repl(vlm, dict(max_new_tokens=2), report=stats_report, stdin=script, stdout=io.StringIO(),
                stderr=err) == 0
    assert err.getvalue().count("[no turn answered yet]") == 2 and "prompt tokens" not in err.getvalue()
    monkeypatch.setattr("sys.stdin", None)
    assert repl(vlm, {}, stdout=io.StringIO(), stderr=io.StringIO()) == 0


def test_vlmrt_chat_command(default_bundle, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n/stats\n/quit\nnever read\n"))
    capsys.readouterr()
    assert cli.main(["chat", str(default_bundle.bundle), "--image", str(image_file("chelsea.png", None)),
                     "--max-new-tokens", "3", "--stop", "\x00"]) == 0
    out, err = capsys.readouterr()
    assert len(out.strip("\n").splitlines()) == 1 and "prompt tokens" in err and "caches:" in err
