"""A short run of the property-based fuzzing in tests/fuzz_targets.py (derandomized: the same cases every run, a few
seconds per property); benchmarks/fuzz.py is the long run."""

from __future__ import annotations

import json
import shutil

from fuzz_targets import (hostile_media, image_property, manifest_property, media_path_property,
                          prepare_bundle_copy, scratch, video_property)


def test_manifest_loader_works_or_raises_bundle_error(default_bundle):
    original = (default_bundle.bundle / "manifest.json").read_bytes()
    base = json.loads(original)
    root = scratch()
    try:
        manifest_property(base, prepare_bundle_copy(default_bundle.bundle, root / "bundle"), max_examples=150)()
    finally:
        shutil.rmtree(root)
    assert (default_bundle.bundle / "manifest.json").read_bytes() == original  # the fixture other tests use is intact


def test_image_loader_works_or_raises_image_error():
    root = scratch()
    try:
        image_property(root, max_examples=400)()
    finally:
        shutil.rmtree(root)


def test_message_text_never_becomes_a_control_token(default_bundle):
    """fuzz_targets.prompt_property on the fixture bundle's template and tokenizer (SmolVLM's: <end_of_utterance>
    turns, row / column markers, <image> refused): 300 conversations."""
    from tokenizers import Tokenizer

    from fuzz_targets import prompt_property
    from vlmrt.format import manifest as mf

    m = mf.load(default_bundle.bundle, verify=False)
    tok = Tokenizer.from_file(str(default_bundle.bundle / m.tokenizer_file))
    prompt_property(m.prompt, tok, max_examples=300)()


def test_huge_image_headers_are_refused_before_decoding():
    """Decompression amplification in six formats (tests/amplify.py): any declared size is read from the header and,
    under a smaller pixel limit, refused without decoding: 300 cases, the peak RSS of a fresh process running them
    grown by under 100 MB (one decode of the larger ones would allocate GBs). A fresh process: in the suite's own,
    after a thousand tests, the same cases measured 189 MB of re-faulted heap (2026-12-07, a full run)."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    code = ("import amplify, fuzz_targets; "
            "print(amplify.peak_growth_mb(fuzz_targets.amplification_property(max_examples=300))[1])")
    r = subprocess.run([sys.executable, "-c", code], cwd=here, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    grown = float(r.stdout.split()[-1])
    assert grown < 100, f"{grown:.0f} MB"


def test_video_reader_works_or_raises_video_error():
    """Mutated and truncated corpus clips, random bytes and FFmpeg's instruction texts (SDP, HLS, concat, ...): a clip
    whose frames decode or one VideoError; FFmpeg only ever opens them with an allowed demuxer, and closes them."""
    import pytest

    pytest.importorskip("av")
    video_property(max_examples=300)()


def test_media_folder_paths_are_a_file_inside_or_a_400():
    """The server's media-folder paths (`--media-dir`), built from loops, links out, FIFOs, devices, NUL bytes, long
    names and random text: the one regular file inside the folder, or a 400 that never names the folder."""
    import pytest

    pytest.importorskip("starlette")
    root = scratch()
    try:
        media_path_property(hostile_media(root), max_examples=400)()
    finally:
        shutil.rmtree(root)


def test_typed_json_fast_path_takes_what_the_field_check_takes(default_bundle):
    """typed_json.build's fast path (one validator per type hint, made once) accepts exactly what the field-by-field
    check accepts, with the same values: for every type hint the manifest's dataclasses use, on arbitrary JSON and on
    the values a hint confuses (true for an integer, 1 for a float, 10**400, null), and on the fuzzer's mutated
    manifests. What it refuses goes to the field check, which names the field."""
    import dataclasses
    import typing

    from fuzz_targets import json_value, mutated_manifest
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from vlmrt.format import manifest as mf
    from vlmrt.format import typed_json as tj

    classes, hints, todo = [], [], [mf.Manifest, mf.FileEntry, mf.MappedWeight]
    while todo:
        c = todo.pop()
        if c not in classes:
            classes.append(c)
            for t in typing.get_type_hints(c).values():
                stack = [t]
                while stack:  # the hint and every hint inside it (list[int | str] -> int | str -> int, str)
                    h = stack.pop()
                    if dataclasses.is_dataclass(h):
                        todo.append(h)
                    elif h not in hints:
                        hints.append(h)
                        stack += typing.get_args(h)

    def outcome(fast, slow):
        try:
            a = fast()
        except tj._Bad:
            a = tj._Bad
        try:
            b = slow()
        except tj.Malformed:
            b = tj._Bad
        return a, b

    tricky = st.sampled_from([True, False, 0, 1, -1, 1.0, 0.5, 10**400, None, "", "x", [], {}, [1], [True], ["a", 2],
                              [[1.0, 2]], {"a": 1}, {"a": {"b": [[1.0]]}}, {"a": "b"}, {"a": {"b": True}}])
    base = json.loads((default_bundle.bundle / "manifest.json").read_bytes())

    @settings(max_examples=400, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(hints), st.one_of(tricky, json_value, st.lists(tricky, max_size=3)), mutated_manifest(base))
    def prop(hint, value, data):
        a, b = outcome(lambda: tj._fast(hint)(value), lambda: tj._check(value, hint, "x"))
        assert a == b and type(a) is type(b), (hint, value)
        d = json.loads(data)
        if isinstance(d, dict):
            a, b = outcome(lambda: tj._fast_build(mf.Manifest, d), lambda: tj._build(mf.Manifest, d, ""))
            assert a == b

    prop()
