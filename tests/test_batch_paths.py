"""`vlmrt batch` in process on the tiny fixture bundle, where its paths meet: --retry-errors turning a transient URL
failure (a loopback server that answers 503 once, then the image) into the answer, and a job SIGKILLed mid-run
(a real process, not a hand-cut line) then rerun: the resumed OUT holds every id once, each with the answer of an
uninterrupted run."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

from http_images import serve_images
from vlmrt import cli
from vlmrt.batch import records
from vlmrt.runtime.vlm import VLM


def png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(60 + i).integers(0, 256, (24 + i, 96, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def lines_of(out) -> dict:
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    by = {records.id_key(d["id"]): d for d in rows}
    assert len(by) == len(rows), "an id written twice"
    return by


def batch(capsys, *argv) -> dict:
    capsys.readouterr()
    # --allow-local-urls: the job's URL is on loopback, which a batch refuses by default (docs/batch.md)
    assert cli.main(["batch", *map(str, argv), "--allow-local-urls", "--quiet", "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_retry_errors_turns_a_transient_url_failure_into_the_answer(default_bundle, capsys, tmp_path):
    b = default_bundle.bundle
    (tmp_path / "a.png").write_bytes(png(0))
    with serve_images({"/flaky.png": ("flaky", 1, png(1))}) as url:
        src = tmp_path / "in.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in [
            {"id": "file", "image": "a.png", "prompt": "What is this?"},
            {"id": "url", "image": url + "/flaky.png", "prompt": "What is this?"}]))
        out = tmp_path / "out.jsonl"
        s = batch(capsys, b, "--input", src, "--output", out, "--max-new-tokens", 8)
        assert (s["answered"], s["errors"]) == (1, 1)
        first = lines_of(out)
        assert "503" in first['"url"']["error"]
        s = batch(capsys, b, "--input", src, "--output", out, "--max-new-tokens", 8, "--retry-errors")
        assert (s["answered"], s["errors"], s["skipped"]) == (1, 0, 1)
    by = lines_of(out)
    assert by['"file"'] == first['"file"']
    want = VLM.load(b)("What is this?", Image.open(io.BytesIO(png(1))), max_new_tokens=8)
    assert (by['"url"']["text"], by['"url"']["token_ids"]) == (want.text, want.token_ids)


def test_a_sigkilled_batch_resumes_to_the_uninterrupted_output(default_bundle, capsys, tmp_path):
    b = default_bundle.bundle
    n = 8
    for i in range(n):
        (tmp_path / f"{i}.png").write_bytes(png(i))
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "image": f"{i}.png", "prompt": f"Describe picture {i}."}) + "\n"
                           for i in range(n)))
    opts = ["--max-new-tokens", "100", "--ignore-eos"]
    ref = tmp_path / "ref.jsonl"
    s = batch(capsys, b, "--input", src, "--output", ref, *opts)
    assert s["answered"] == n

    out = tmp_path / "out.jsonl"
    p = subprocess.Popen([sys.executable, "-m", "vlmrt.cli", "batch", str(b), "--input", str(src), "--output", str(out),
                          *opts, "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300  # bounded
        while time.monotonic() < deadline and p.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= 2:
                break
            time.sleep(0.01)
        assert p.poll() is None, f"the job ended before it was killed: {p.stderr.read().decode()[-500:]}"
        os.kill(p.pid, signal.SIGKILL)
        assert p.wait(30) == -signal.SIGKILL
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
    done = out.read_bytes().count(b"\n")
    assert 2 <= done < n, done
    s = batch(capsys, b, "--input", src, "--output", out, *opts)
    assert s["skipped"] == done and s["answered"] == n - done
    got, want = lines_of(out), lines_of(ref)
    assert set(got) == set(want)
    for k in want:
        assert (got[k]["text"], got[k]["token_ids"]) == (want[k]["text"], want[k]["token_ids"]), k
