"""Cold start: a bundle's files are hashed once and the verification remembered (vlmrt/verify_record.py) -- an
altered file is still refused -- and the vision session is loaded only when a request has an image."""

import os
import shutil
import time

import numpy as np
import pytest

from vlmrt.format import manifest as mf
from vlmrt.format import verify_record
from vlmrt.runtime.vlm import VLM


@pytest.fixture
def copy(default_bundle, tmp_path, monkeypatch):
    """A private copy of the default bundle, the record cache in tmp_path, the clock 10 s ahead (so that the fresh
    copy is not 'changed too recently' to be remembered), and a log of the files hashed."""
    b = tmp_path / "bundle"
    shutil.copytree(default_bundle.bundle, b)
    monkeypatch.setenv("VLMRT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(verify_record, "_now_ns", lambda: verify_record.time.time_ns() + 10 * 10**9)
    hashed = []
    real = mf.sha256_file
    monkeypatch.setattr(mf, "sha256_file", lambda p: hashed.append(p.name) or real(p))
    return b, hashed


def flip(path, keep_mtime=True):
    """One bit flipped in place (same size), the mtime put back as it was (utime: what a user can do)."""
    time.sleep(0.05)  # past the timestamp tick of the copy (the real clock's RACY_NS rule covers what is closer)
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(100)
        c = f.read(1)
        f.seek(100)
        f.write(bytes([c[0] ^ 1]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_ctime_ns != st.st_ctime_ns


def test_verified_once_then_remembered(copy):
    b, hashed = copy
    files = sorted(mf.load(b, verify=False).files)
    mf.load(b)
    assert sorted(hashed) == files  # first load: every file hashed
    hashed.clear()
    mf.load(b)
    assert hashed == []  # unchanged: nothing hashed
    rec = list((b.parent / "cache" / "verified").iterdir())
    assert len(rec) == 1 and rec[0].stat().st_mode & 0o077 == 0


@pytest.mark.parametrize("victim", ["decoder.data", "tokenizer.json", "embed.npy", "vision.onnx"])
def test_altered_after_verification_is_refused(copy, victim):
    """Same size, mtime put back: the ctime tells. The refusal holds on every later load."""
    b, hashed = copy
    mf.load(b)
    flip(b / victim)
    for _ in range(2):
        with pytest.raises(mf.BundleError, match=f"sha256 mismatch.*{victim}"):
            mf.load(b)


def test_replaced_file_and_edited_manifest_are_hashed_again(copy):
    b, hashed = copy
    mf.load(b)
    hashed.clear()
    # a file replaced by a rename (another inode), its content and timestamps the same
    shutil.copy2(b / "embed.npy", b / "embed.tmp")
    os.replace(b / "embed.tmp", b / "embed.npy")
    mf.load(b)
    assert hashed == ["embed.npy"]
    # the manifest rewritten (here: the same content re-serialized): its record no longer applies
    m = (b / "manifest.json").read_text()
    (b / "manifest.json").write_text(m + "\n")
    hashed.clear()
    mf.load(b)
    assert sorted(hashed) == sorted(mf.load(b, verify=False).files)


def test_recent_changes_and_foreign_records_are_not_trusted(copy, monkeypatch):
    b, hashed = copy
    monkeypatch.setattr(verify_record, "_now_ns", verify_record.time.time_ns)  # the real clock: files just copied
    mf.load(b)
    hashed.clear()
    mf.load(b)
    assert len(hashed) == len(mf.load(b, verify=False).files)  # changed < RACY_NS ago: not remembered
    monkeypatch.setattr(verify_record, "_now_ns", lambda: verify_record.time.time_ns() + 10 * 10**9)
    mf.load(b)
    rec = next((b.parent / "cache" / "verified").iterdir())
    rec.chmod(0o666)  # a record others could have written is ignored
    hashed.clear()
    mf.load(b)
    assert len(hashed) == len(mf.load(b, verify=False).files)


def test_vision_session_loaded_on_first_image(copy):
    b, _ = copy
    vlm = VLM.load(b, threads=1)
    assert not vlm.bundle.sessions.loaded("vision") and vlm.bundle.sessions.loaded("decode")
    text = vlm("hi", max_new_tokens=3, ignore_eos=True)
    assert not vlm.bundle.sessions.loaded("vision") and text.stats.vision_load_s == 0
    img = (np.arange(64 * 48 * 3) % 251).astype(np.uint8).reshape(48, 64, 3)
    from PIL import Image

    r = vlm("hi", Image.fromarray(img), max_new_tokens=3, ignore_eos=True)
    assert vlm.bundle.sessions.loaded("vision") and r.stats.vision_load_s > 0
    assert r.stats.ttft_s >= r.stats.vision_load_s + r.stats.vision_s
    again = vlm("hi", Image.fromarray(img), max_new_tokens=3, ignore_eos=True)
    assert again.stats.vision_load_s == 0 and again.token_ids == r.token_ids
    # the same answers as a bundle whose sessions were all loaded up front
    eager = VLM.load(b, threads=1)
    eager.bundle.sessions["vision"]
    assert eager("hi", Image.fromarray(img), max_new_tokens=3, ignore_eos=True).token_ids == r.token_ids


def test_text_only_run_loads_only_what_it_needs(copy):
    """A text-only greedy `vlmrt run` imports neither Pillow, the http client, numpy.random nor the export side (imports are most of a
    short answer's process time after the session: docs/performance.md#cold-start-against-llamacpp-2026-12-01); an image
    request still gets them, and a PIL image is still taken."""
    import json
    import subprocess
    import sys

    b, _ = copy
    code = ("import sys; from vlmrt import cli; rc = cli.main(sys.argv[1:]); "
            "print(sorted(m for m in ('PIL', 'http.client', 'urllib.request', 'vlmrt.export', 'torch', 'onnx', 'numpy.random') "
            "if m in sys.modules)); sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code, "run", str(b), "--prompt", "hi", "--max-new-tokens", "2", "--json"],
                       capture_output=True, text=True, timeout=300, env=os.environ)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "[]"
    assert json.loads(p.stdout.strip().splitlines()[-2])["stats"]["generated_tokens"] == 2
    from PIL import Image

    img = Image.fromarray((np.arange(32 * 32 * 3) % 251).astype(np.uint8).reshape(32, 32, 3))
    assert VLM.load(b, threads=1)("hi", img, max_new_tokens=1, ignore_eos=True).stats.image_tiles >= 1
