"""Processor settings in both layouts (issue 43): transformers 5 saves a processor as one processor_config.json with
its image and video processors' settings nested in it, older checkpoints as separate files. vlmrt's Checkpoint
(families/checkpoint.py) reads each where transformers 5.24 itself reads it, held here to transformers' own readers
on every mix of the two layouts: ImageProcessingMixin.get_image_processor_dict, BaseVideoProcessor
.get_video_processor_dict, ProcessorMixin.get_processor_dict, and the tokenizer's named tokens as
PreTrainedTokenizerBase.from_pretrained sets them. The family tests that export such checkpoints are in
test_family_conformance.py (test_nested_processor_config_*) and test_video.py."""

from __future__ import annotations

import json

import pytest

from vlmrt.families.checkpoint import Checkpoint

pytest.importorskip("transformers")

IMAGE = {"image_processor_type": "SmolVLMImageProcessor", "size": {"longest_edge": 96}, "do_image_splitting": True,
         "max_image_size": {"longest_edge": 32}, "resample": 1}
STALE_IMAGE = {**IMAGE, "size": {"longest_edge": 1456}, "do_image_splitting": False}
VIDEO = {"video_processor_type": "SmolVLMVideoProcessor", "video_sampling": {"fps": 1, "max_frames": 4,
         "video_size": {"longest_edge": 64}}, "max_image_size": {"longest_edge": 32}}
STALE_VIDEO = {**VIDEO, "video_sampling": {"fps": 2, "max_frames": 64, "video_size": {"longest_edge": 64}}}

# name -> the processor files written (None: absent)
LAYOUTS = {
    "legacy": {"preprocessor_config.json": IMAGE, "video_preprocessor_config.json": VIDEO,
               "processor_config.json": {"processor_class": "SmolVLMProcessor", "image_seq_len": 4}},
    "nested": {"processor_config.json": {"processor_class": "SmolVLMProcessor", "image_seq_len": 4,
                                         "image_processor": IMAGE, "video_processor": VIDEO}},
    # a fine-tuned checkpoint saved over its hub snapshot: the old files stay beside the nested ones
    "nested-over-stale-files": {"preprocessor_config.json": STALE_IMAGE, "video_preprocessor_config.json": STALE_VIDEO,
                                "processor_config.json": {"image_seq_len": 4, "image_processor": IMAGE,
                                                          "video_processor": VIDEO}},
    "nested-image-legacy-video": {"video_preprocessor_config.json": VIDEO,
                                  "processor_config.json": {"image_seq_len": 4, "image_processor": IMAGE}},
    # (a processor saved without a video processor writes "video_processor": null)
    "nested-null-video": {"video_preprocessor_config.json": VIDEO,
                          "processor_config.json": {"image_processor": IMAGE, "video_processor": None}},
    "image-file-only": {"preprocessor_config.json": IMAGE},  # (the video processor reads the image processor's file)
    "legacy-processor-file-no-nested": {"preprocessor_config.json": IMAGE, "processor_config.json": {"image_seq_len": 9}},
    "none": {},
    "processor-file-without-image": {"processor_config.json": {"image_seq_len": 4}},
}


def write(folder, files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, d in files.items():
        (folder / name).write_text(json.dumps(d))
    return Checkpoint(folder, {})


def transformers_reads(read, folder):
    """transformers' reader on folder: its dict, or None where it raises (no such settings)."""
    try:
        return read(str(folder))[0]
    except OSError:
        return None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_settings_are_read_where_transformers_reads_them(layout, tmp_path):
    from transformers.image_processing_base import ImageProcessingMixin
    from transformers.processing_utils import ProcessorMixin
    from transformers.video_processing_utils import BaseVideoProcessor

    ck = write(tmp_path / layout, LAYOUTS[layout])
    assert ck.image_processor() == transformers_reads(ImageProcessingMixin.get_image_processor_dict, ck.path)
    assert ck.video_processor() == transformers_reads(BaseVideoProcessor.get_video_processor_dict, ck.path)
    own = ProcessorMixin.get_processor_dict(str(ck.path))[0]
    assert ck.processor_settings() == {k: v for k, v in own.items() if k not in ("image_processor", "video_processor")}
    if "processor_config.json" in LAYOUTS[layout] and "image_processor" in LAYOUTS[layout]["processor_config.json"]:
        assert ck.image_processor() == IMAGE  # (the stale file beside it is not read)


def test_no_image_processor_settings_is_one_line(tmp_path):
    ck = write(tmp_path / "none", LAYOUTS["processor-file-without-image"])
    with pytest.raises(ValueError) as e:
        ck.require_image_processor("SmolVLMProcessor")
    msg = str(e.value)
    assert "\n" not in msg and "no image processor settings" in msg and "preprocessor_config.json" in msg


def test_a_nested_object_that_is_not_an_object_is_refused(tmp_path):
    ck = write(tmp_path / "bad", {"processor_config.json": {"image_processor": [1, 2]}})
    with pytest.raises(ValueError, match="processor_config.json's 'image_processor' is not a JSON object"):
        ck.image_processor()


TOKEN_NAMES = ("image_token", "fake_image_token", "global_image_token", "end_of_utterance_token")


@pytest.mark.parametrize("layout", ["top-level", "extra-special-tokens", "both", "model-specific-only"])
def test_named_tokens_are_the_tokenizers_attributes(layout, tmp_path):
    """The processors read their marker tokens as tokenizer attributes: vlmrt's named_tokens gives what
    AutoTokenizer.from_pretrained sets, in the transformers 4 layout (top-level keys), transformers 5's
    (an extra_special_tokens object, which wins) and an explicit model_specific_special_tokens object."""
    from transformers import AutoTokenizer

    from fixtures import make_tokenizer

    make_tokenizer(tmp_path)
    base = json.loads((tmp_path / "tokenizer_config.json").read_text())
    base = {k: v for k, v in base.items() if k not in TOKEN_NAMES and k != "additional_special_tokens"}
    top = {"image_token": "<image>", "fake_image_token": "<fake_token_around_image>"}
    extra = {"image_token": "<global-img>", "global_image_token": "<image>"}  # (names swapped: which one is read shows)
    cfg = {"top-level": {**base, **top}, "extra-special-tokens": {**base, "extra_special_tokens": extra},
           "both": {**base, **top, "extra_special_tokens": extra},
           "model-specific-only": {**base, "model_specific_special_tokens": extra}}[layout]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    got = Checkpoint(tmp_path, {}).named_tokens()
    for name in TOKEN_NAMES:
        assert got.get(name) == getattr(tok, name, None), name
    assert any(got.get(n) for n in TOKEN_NAMES)


TEMPLATES = {"processor-key": "P{{ messages }}", "json": "J{{ messages }}", "jinja": "K{{ messages }}"}


@pytest.mark.parametrize("files", [("jinja",), ("json",), ("json", "jinja"), ("processor-key", "json", "jinja"),
                                   ("processor-key",)])
def test_chat_template_is_the_one_transformers_reads(files, tmp_path):
    """The processor's chat template where ProcessorMixin.get_processor_dict takes it from: processor_config.json's
    key, else chat_template.json (over chat_template.jinja: a processor saved by transformers 5 over a snapshot
    leaves the old json beside the new jinja, and transformers reads the json), else the jinja."""
    from transformers.processing_utils import ProcessorMixin

    if "processor-key" in files:
        (tmp_path / "processor_config.json").write_text(json.dumps({"chat_template": TEMPLATES["processor-key"]}))
    if "json" in files:
        (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATES["json"]}))
    if "jinja" in files:
        (tmp_path / "chat_template.jinja").write_text(TEMPLATES["jinja"])
    want = ProcessorMixin.get_processor_dict(str(tmp_path))[0]["chat_template"]
    assert Checkpoint(tmp_path, {}).chat_template() == want == TEMPLATES[files[0]]
