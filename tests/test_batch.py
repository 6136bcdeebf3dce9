"""`vlmrt batch` (issue 20): a data set answered into a JSONL file, in process or on Ray Data actors.

Pure parts first (records, OUT's repair / resume / dedupe, the progress bar, the one-line errors), then the easy-VQA
demo model: every record shape (path, loopback URL, data URI, two images, a conversation, a missing image, a bad
line) answered by `--workers 1` in process and by 2 Ray Data actors, one of them killed mid-run, token for token
as `vlm.generate` / `vlm.chat` on a fresh VLM and as `vlmrt run --json`. Ray runs as `vlmrt batch` starts it
(a local instance on 127.0.0.1, no dashboard, usage stats off): one Ray start in the module.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from vlmrt import cli
from vlmrt.batch import output, records, runner
from vlmrt.progress import Meter

ASSETS = Path(__file__).resolve().parent / "assets"


# ---------------------------------------------------------------- records, OUT, the bar (no model)

def _jsonl(path: Path, lines: list) -> Path:
    path.write_bytes(b"".join((ln if isinstance(ln, bytes) else json.dumps(ln).encode()) + b"\n" for ln in lines))
    return path


def test_records_of_a_jsonl_file(tmp_path):
    """Every record shape becomes messages (relative paths resolved against the file's folder); each bad record is
    its own error, with a `line-N` id when it has no usable id of its own."""
    uri = "data:image/png;base64," + base64.b64encode((ASSETS / "chelsea.png").read_bytes()[:64]).decode()
    conv = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "sub/b.png"}},
                                         {"type": "text", "text": "and this?"}]}]
    src = _jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "image": "a.png", "prompt": "what?"},
        {"id": 7, "image": ["/abs/x.png", "http://127.0.0.1:9/y.png", uri]},  # --prompt
        {"id": "c", "messages": conv},
        b"{not json",
        {"image": "a.png", "prompt": "no id"},
        {"id": "a", "image": "b.png", "prompt": "again"},
        {"id": "d", "prompt": "x", "messages": conv},
        {"id": "e", "messages": [{"role": "assistant", "content": "hi"}]},
        {"id": "f", "image": 3, "prompt": "x"},
        b"",
        {"id": "g", "prompt": "text only"},
        [1, 2],
    ])
    rs = records.read_records(src, "default?")
    got = {r.key: (r.messages, r.error) for r in rs}
    assert [r.id for r in rs] == ["a", 7, "c", "line-4", "line-5", "line-6", "d", "e", "f", "g", "line-12"]
    assert got['"a"'][0] == [{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "a.png")},
                                                          {"type": "text", "text": "what?"}]}]
    assert [p.get("image") for p in got["7"][0][0]["content"]] == ["/abs/x.png", "http://127.0.0.1:9/y.png", uri, None]
    assert got["7"][0][0]["content"][-1]["text"] == "default?"
    assert got['"c"'][0][0]["content"][0]["image_url"]["url"] == str(tmp_path / "sub" / "b.png")
    assert conv[0]["content"][0]["image_url"]["url"] == "sub/b.png"  # the record itself is left alone
    assert got['"g"'] == ([{"role": "user", "content": [{"type": "text", "text": "text only"}]}], None)
    errors = {r.id: r.error for r in rs if r.error}
    assert errors == {
        "line-4": "line 4: not JSON (Expecting property name enclosed in double quotes)",
        "line-5": "line 5: a record needs an id (a non-empty string or an integer)",
        "line-6": 'line 6: duplicate id "a" (first on line 1)',
        "d": "a record has either messages or prompt (+ image), not both",
        "e": "the last message must be the user's (the answer is the next assistant turn)",
        "f": "image must be a path, an http(s) URL or a data URI, or a list of them",
        "line-12": "line 12: a record must be a JSON object",
    }
    assert [r.error for r in records.read_records(_jsonl(tmp_path / "p.jsonl", [{"id": 1}]), None)] == [
        "the record has no prompt (nor messages) and no --prompt was given"]
    assert json.loads(rs[0].request()) == {"id": "a", "messages": got['"a"'][0]}
    with pytest.raises(records.InputError, match="no records"):
        records.read_records(_jsonl(tmp_path / "empty.jsonl", [b"", b"  "]), None)
    with pytest.raises(records.InputError, match="no such file or folder"):
        records.read_records(tmp_path / "nope.jsonl", None)


def test_records_of_a_folder(tmp_path):
    for name in ("b.png", "a.JPG", "sub/c.webp", ".hidden/d.png", "notes.txt", ".e.png"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    rs = records.read_records(tmp_path, "what?")
    assert [r.id for r in rs] == ["a.JPG", "b.png", "sub/c.webp"]
    assert rs[2].messages[0]["content"][0]["image"] == str(tmp_path / "sub" / "c.webp")
    with pytest.raises(records.InputError, match="needs --prompt"):
        records.read_records(tmp_path, None)
    with pytest.raises(records.InputError, match="no image files"):
        records.read_records(_only_text(tmp_path), "q")


def _only_text(tmp_path: Path) -> Path:
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("not an image")
    return tmp_path / "text"


def test_output_repair_resume_and_dedupe(tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert output.repair(out) == 0 and output.done_keys(out) == (set(), set())
    out.write_bytes(b'{"id": "a", "text": "x"}\n{"id": 2, "error": "bad"}\n{"id": "c", "te')
    assert output.repair(out) == len('{"id": "c", "te')
    assert "ended in a partial line" in capsys.readouterr().err
    assert out.read_bytes() == b'{"id": "a", "text": "x"}\n{"id": 2, "error": "bad"}\n'
    assert output.repair(out) == 0
    assert output.done_keys(out) == ({'"a"', "2"}, {"2"})
    w = output.Writer(out, {'"a"', "2"})
    assert w.write('"c"', '{"id": "c", "text": "y"}') and not w.write('"c"', '{"id": "c", "text": "z"}')
    assert not w.write('"a"', '{"id": "a", "text": "again"}')
    w.close()
    assert w.duplicates == 2 and out.read_text().count('"id": "c"') == 1
    assert output.drop_errors(out) == 1 and output.done_keys(out) == ({'"a"', '"c"'}, set())
    one = tmp_path / "one.jsonl"
    one.write_bytes(b'{"id": "only", "te')  # no newline at all: everything is the torn line
    assert output.repair(one, say=False) == len(b'{"id": "only", "te') and one.read_bytes() == b""
    (tmp_path / "other.jsonl").write_text('{"id": 1}\nhello\n')
    with pytest.raises(output.OutputError, match="line 2 is not a vlmrt batch line"):
        output.done_keys(tmp_path / "other.jsonl")


def test_meter_line():
    m = Meter(400, enabled=False)
    m.t0 -= 10.0
    m.advance(100)
    assert m.line().startswith("[######..................] 100/400 records  10.0 records/s  ETA 0:30")


def _one_line_error(capsys, argv, *want):
    rc = cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and err[0].startswith("vlmrt: error: "), err
    for w in want:
        assert w in err[0], err[0]


def test_bad_jobs_are_one_line(tmp_path, capsys, monkeypatch):
    """Without Ray, --workers 2 says what to install; a missing input, an OUT that is a folder or not ours, a
    bundle that is not one: one line each, and OUT not created or left as it was."""
    src = _jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    out = tmp_path / "out.jsonl"
    base = ["batch", str(tmp_path), "--input", str(src), "--output", str(out)]
    monkeypatch.setattr(runner, "ray_or_none", lambda: None)
    _one_line_error(capsys, base + ["--workers", "2"], "--workers 2 runs on Ray, which is not installed",
                    "pip install 'vlmrt[batch]'")
    _one_line_error(capsys, base + ["--workers", "0"], "--workers must be >= 1")
    _one_line_error(capsys, base, "is not a vlmrt bundle")
    _one_line_error(capsys, ["batch", str(tmp_path), "--input", str(tmp_path / "x"), "--output", str(out)],
                    "no such file or folder")
    assert not out.exists()
    _one_line_error(capsys, base[:-1] + [str(tmp_path)], "is a folder")
    out.write_text("not ours\n")
    _one_line_error(capsys, base, "line 1 is not a vlmrt batch line")
    assert out.read_text() == "not ours\n"
