"""The shared runner: every registered family (vlmrt.families.REGISTRY), every one of its tiny checkpoints
(family_cases.FAMILIES), exported once and held against transformers on the same weights: pixels and prompt ids equal
the family's processor's, greedy ids equal transformers' generate in both modes (kv, hybrid), with and without an
image, the EOS stop where transformers stops, the first logits to float32 rounding; continuous batching (several
conversations decoding together answer as each alone); streaming, stats and seeded sampling on each family's first
case; the first case with its processor saved as transformers 5 saves it (one processor_config.json, the settings
nested) read as transformers reads it, and without processor settings refused. A new family is exercised here by registering it in vlmrt and in
family_cases.py (test_every_registered_family_is_tested fails until both are done)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import IMAGES, image_file
from family_cases import FAMILIES, all_cases, nested
import oracle
from family_runner import cli_json, hf_run
from vlmrt import families
from vlmrt.runtime.media import image as img_ops
from vlmrt.runtime.answers import AnswerLoop
from vlmrt.runtime.bundle import Bundle
from vlmrt.runtime.vlm import VLM

pytest.importorskip("transformers")

PROMPT = "What is in the image? Describe the colours."
GREEDY_IMAGES = ["chelsea.png", "page.png", "tall", None]  # a photo, a wide page, a tall synthetic, no image
CASES = all_cases()


def family_of(ex) -> str:
    return next(name for name, fc in FAMILIES.items() if ex.case in fc.cases)


@pytest.fixture(params=CASES, ids=[f"{f}-{c.name}" for f, c in CASES])
def case(request, tmp_path_factory):
    name, c = request.param
    return FAMILIES[name].exported(c, tmp_path_factory)


@pytest.fixture(params=list(FAMILIES))
def first_case(request, tmp_path_factory):
    fc = FAMILIES[request.param]
    return fc.exported(fc.cases[0], tmp_path_factory)


def test_every_registered_family_is_tested():
    """Registering a family in vlmrt without its test cases here (or the other way round) fails."""
    assert sorted(f.name for f in families.registered()) == sorted(FAMILIES)
    assert all(fc.cases for fc in FAMILIES.values())
    names = [c.name for _, c in CASES]
    assert len(names) == len(set(names))  # conftest.export_once keys its exports by case name


@pytest.mark.parametrize("image", IMAGES)
def test_pixels_and_prompt_ids_equal_hf_processor(case, image, tmp_path):
    path = image_file(image, tmp_path)
    prompt_ids, pixels, _ = hf_run(case, path, PROMPT, 0)
    if case.family.pixel_batch_dim:
        assert pixels.shape[0] == 1
        pixels = pixels[0]
    if case.family.native:  # one image's patch rows: the one tile of the smart_resize op
        pixels = pixels[None]
    vlm = VLM.load(case.bundle)
    tiles = img_ops.preprocess(img_ops.load_image(path), vlm.manifest.image)
    assert tiles.pixels.shape == pixels.shape
    np.testing.assert_array_equal(tiles.pixels, pixels)  # same Pillow resizes, same float ops: exact
    assert vlm.prompt(PROMPT, [path]).ids == prompt_ids


@pytest.mark.parametrize("mode", ["kv", "hybrid"])
@pytest.mark.parametrize("image", GREEDY_IMAGES)
def test_greedy_ids_equal_transformers(case, image, mode, tmp_path, capsys):
    path = image_file(image, tmp_path) if image else None
    prompt_ids, _, want = hf_run(case, path, PROMPT, 24)
    args = ["--image", path] if path else []
    got = cli_json(capsys, case.bundle, *args, "--prompt", PROMPT, "--mode", mode, "--max-new-tokens", 24, "--ignore-eos")
    assert got["prompt_tokens"] == len(prompt_ids)
    assert len(set(want)) > 4  # the reference is not degenerate
    assert got["token_ids"] == want


def test_text_only_and_eos_stop_equal_transformers(case, capsys):
    text = "Describe a red square on a blue page."
    prompt_ids, _, want = hf_run(case, None, text, 24)
    got = cli_json(capsys, case.bundle, "--prompt", text, "--max-new-tokens", 24, "--ignore-eos")
    assert got["prompt_tokens"] == len(prompt_ids) and got["token_ids"] == want
    # without --ignore-eos both stop at the first EOS, the EOS ids being transformers' own (generation_config):
    # transformers' ids end with the EOS it stopped at, vlmrt's stop before it; the rest is equal, length included
    model, _ = case.hf()
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos)
    assert eos
    _, _, want = hf_run(case, None, text, 60, ignore_eos=False)
    got = cli_json(capsys, case.bundle, "--prompt", text, "--max-new-tokens", 60)
    stopped = want[-1] in eos
    assert got["token_ids"] == (want[:-1] if stopped else want)
    assert not eos & set(got["token_ids"])
    assert got["stats"]["stop_reason"] == ("eos" if stopped else "length")
    expected = FAMILIES[family_of(case)].eos_stops.get(case.case.name)
    if expected is not None:  # measured: transformers says EOS as its expected-th token here
        assert stopped and len(want) == expected


def test_first_logits_close_to_transformers(case):
    """The decoder graph's logits after an image prompt match transformers' to float32 rounding (measured max |diff|
    ~2e-6)."""
    import torch

    model, _ = case.hf()
    vlm = VLM.load(case.bundle)
    tiles = img_ops.preprocess(img_ops.load_image(image_file("chelsea.png", None)), vlm.manifest.image)
    p = vlm.prompt(PROMPT, [image_file("chelsea.png", None)])
    ids, x = p.ids, vlm.decoder_inputs(p)
    image = vlm.manifest.special_tokens.image_token_id
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids]), **oracle.model_image_inputs(case.family, tiles, ids, image)).logits[0, -1].numpy()
    for mode in ("kv", "hybrid"):
        vlm.reset()
        got = vlm.row.prefill(x.embeds, mode, positions=x.positions, rows=x.rows)
        assert np.abs(got - ref).max() < 2e-4 * max(1.0, np.abs(ref).max()), mode


def test_conversations_decoding_together_answer_as_alone(case, tmp_path):
    """Three conversations (an image, another image, none; greedy and seeded sampling; one starting two rounds late)
    over one opened bundle, as the server's slots run them, answer what each answers alone. A family's CPU one-graph
    decoder (kind gqa_in_place) takes a batch: they decode through one decoder call per step, their image encodes and
    prefill blocks between the others' steps; the rows kinds (one sequence per call) get no batch, and the
    scheduler runs their rows one call each per round."""
    m = Bundle.open(case.bundle).manifest

    def user(text, image):
        parts = [{"type": "image_url", "image_url": {"url": str(image_file(image, tmp_path))}}] if image else []
        return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]

    plan = [(user(PROMPT, "chelsea.png"), dict(max_new_tokens=16), 0),
            (user("Tell me a story.", None), dict(max_new_tokens=40, temperature=0.9, seed=3), 0),
            (user("What colour is it?", "tall"), dict(max_new_tokens=16), 2)]
    alone = VLM.load(case.bundle)
    want = []
    for msgs, opts, _ in plan:
        alone.reset()
        list(alone.chat(msgs, ignore_eos=True, **opts))
        want.append(alone.result.token_ids)
    vlms = VLM.slots(Bundle.open(case.bundle), len(plan))
    sched = vlms[0].scheduler
    assert sched.batched == (m.decoder.kind.name == "gqa_in_place") == getattr(m.decoder.kind, "batched", False)
    loop = AnswerLoop(vlms)
    for rnd in range(2000):
        for i, (msgs, opts, at) in enumerate(plan):
            if at == rnd:
                loop.begin(vlms[i].chat_answer(msgs, ignore_eos=True, **opts))
        for i, kind, value in loop.round():
            assert kind != "error", value
        if not loop.busy and rnd > 2:
            break
    assert [v.result.token_ids for v in vlms] == want
    assert sched.widest == (len(plan) if sched.batched else 0)  # they did decode together


def test_streamed_text_equals_decoded_ids(first_case):
    vlm = VLM.load(first_case.bundle)
    path = image_file("chelsea.png", None)
    pieces = list(vlm.generate(PROMPT, path, max_new_tokens=20, ignore_eos=True))
    r = vlm.result
    assert "".join(pieces) == r.text == vlm.bundle.tokenizer.decode(r.token_ids, skip_special_tokens=True)
    s = r.stats
    tiles = img_ops.preprocess(img_ops.load_image(path), vlm.manifest.image)
    several = 0 if first_case.family.native or first_case.family.one_tile else 1  # (such an image is one tile)
    assert s.generated_tokens == 20 and s.prompt_tokens == len(r.prompt_ids) and s.image_tiles == len(tiles.pixels) > several
    assert 0 < s.ttft_s <= s.total_s and s.vision_s > 0 and s.decode_tokens_per_s > 0 and s.peak_rss_mb > 0


def test_sampling_is_seeded(first_case, capsys):
    args = [first_case.bundle, "--prompt", "Tell me a story.", "--max-new-tokens", 16, "--temperature", 1.0,
            "--top-k", 20, "--top-p", 0.9, "--ignore-eos"]
    a = cli_json(capsys, *args, "--seed", 1)["token_ids"]
    assert a == cli_json(capsys, *args, "--seed", 1)["token_ids"]
    assert a != cli_json(capsys, *args, "--seed", 2)["token_ids"]


@pytest.fixture(params=list(FAMILIES))
def nested_case(request, tmp_path_factory):
    return nested(request.param, tmp_path_factory)


HOST_PLAN = ("image", "prompt", "special_tokens", "video", "vision")


def test_nested_processor_config_answers_as_transformers(nested_case, tmp_path_factory, capsys):
    """The first case's processor saved by transformers 5.24's save_pretrained: one processor_config.json with the
    image (and video) processor's settings nested in it; SmolVLM's alone, the others' beside their old separate
    files left with other settings (FamilyCases.stale), which transformers does not read. The export reads the nested
    ones as transformers does: its host plan is the separate-files export's, and on an image that the stale settings
    (or the processor's defaults) tile otherwise the pixels, prompt ids and 24 greedy ids equal transformers' (whose
    processor is built from its own readers: oracle.settings)."""
    ex = nested_case
    legacy = FAMILIES[family_of(ex)].exported(ex.case, tmp_path_factory)
    got, want = ex.manifest(), legacy.manifest()
    assert {k: got.get(k) for k in HOST_PLAN} == {k: want.get(k) for k in HOST_PLAN}
    path = image_file("chelsea.png", None)
    prompt_ids, pixels, want_ids = hf_run(ex, path, PROMPT, 24)
    vlm = VLM.load(ex.bundle)
    tiles = img_ops.preprocess(img_ops.load_image(path), vlm.manifest.image)
    np.testing.assert_array_equal(tiles.pixels, (pixels[None] if ex.family.native else
                                                 pixels[0] if ex.family.pixel_batch_dim else pixels))
    assert vlm.prompt(PROMPT, [path]).ids == prompt_ids
    r = cli_json(capsys, ex.bundle, "--image", path, "--prompt", PROMPT, "--max-new-tokens", 24, "--ignore-eos")
    assert r["prompt_tokens"] == len(prompt_ids) and len(set(want_ids)) > 4 and r["token_ids"] == want_ids


def test_no_processor_settings_is_refused_in_one_line(nested_case, tmp_path, capsys):
    """A checkpoint with no image processor settings (neither processor_config.json's "image_processor" nor
    preprocessor_config.json: transformers' from_pretrained makes no processor of it) is refused by `vlmrt export` in
    one line, exit status 1, nothing written; never exported with the image processor's defaults."""
    import json
    import shutil

    from vlmrt import cli

    ckpt = tmp_path / "ckpt"
    shutil.copytree(nested_case.ckpt, ckpt)
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        (ckpt / name).unlink(missing_ok=True)
    pc = json.loads((ckpt / "processor_config.json").read_text())
    del pc["image_processor"]
    pc.pop("video_processor", None)
    (ckpt / "processor_config.json").write_text(json.dumps(pc))
    out = tmp_path / "out" / "bundle"
    out.parent.mkdir()
    capsys.readouterr()
    assert cli.main(["export", str(ckpt), str(out), "--quiet"]) == 1
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vlmrt: error: ") and "no image processor settings" in err[0], err
    assert "Traceback" not in cap.err + cap.out
    assert list(out.parent.iterdir()) == []
