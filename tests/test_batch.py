"""`vlmrt batch` (issue 20): a data set answered into a JSONL file, in process or on Ray Data actors.

Pure parts first (records, OUT's repair / resume / dedupe, the progress bar, the one-line errors), then the easy-VQA
demo model: every record shape (path, loopback URL, data URI, two images, a conversation, a record held to its own
JSON schema, a missing image, a bad line) answered by `--workers 1` in process and by 2 Ray Data actors, one of them killed mid-run, token for token
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
        "d": "a record has either messages or prompt (+ image / video), not both",
        "e": "the last message must be the user's or a tool result (the answer is the next assistant turn)",
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


def test_records_that_python_cannot_parse_are_their_own_errors(tmp_path):
    """A line nested too deeply for the JSON parser (or for copying its messages), a 5000-digit integer and text or
    an id holding a lone surrogate are each that record's error, not the job's (were a traceback or a job error)."""
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([
        '{"id": 1, "prompt": "hi", "n": 1' + "0" * 5000 + "}",
        "[" * 100_000 + "]" * 100_000,
        '{"id": 3, "messages": ' + "[" * 600 + "]" * 600 + "}",
        '{"id": 4, "prompt": "\\ud800"}',
        '{"id": 5, "messages": [{"role": "user", "content": "\\udc80"}]}',
        '{"id": "\\ud800", "prompt": "hi"}',
        '{"id": 7, "prompt": "fine"}',
        '{"id": "", "prompt": "hi"}']) + "\n")
    rs = records.read_records(src, None)
    assert [(r.id, r.error) for r in rs] == [
        ("line-1", "line 1: not JSON (Exceeds the limit (4300 digits) for integer string conversion: value has 5001 "
                   "digits; use sys.set_int_max_str_digits() to increase the limit)"),
        ("line-2", "line 2: not JSON (nested too deeply)"),
        (3, "messages are nested too deeply"),
        (4, "message 1, part 1: the text is not valid Unicode (it holds a lone surrogate)"),
        (5, "message 1: the text is not valid Unicode (it holds a lone surrogate)"),
        ("line-6", "line 6: a record needs an id (a non-empty string or an integer); this one holds a lone surrogate"),
        (7, None),
        ("line-8", "line 8: a record needs an id (a non-empty string or an integer)")]  # no surrogate in an empty id


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
    m.advance(50)  # the clock starts at the first items done (after the job's startup)
    assert m.line() == "[###.....................] 50/400 records  ? records/s  ETA ?"
    m.first = (m.first[0] - 100.0, m.first[1])
    m.advance(100)
    assert m.line().startswith("[#########...............] 150/400 records  1.0 records/s  ETA 4:10"), m.line()


def _one_line_error(capsys, argv, *want):
    rc = cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and err[0].startswith("vlmrt: error: "), err
    for w in want:
        assert w in err[0], err[0]


def test_bad_jobs_are_one_line(tmp_path, capsys, monkeypatch):
    """Without Ray, --workers 2 says what to install; the URL policy's two flags at once (as `vlmrt serve`), a missing
    input, an OUT that is a folder or not ours, a bundle that is not one: one line each, and OUT not created or left
    as it was."""
    src = _jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    out = tmp_path / "out.jsonl"
    base = ["batch", str(tmp_path), "--input", str(src), "--output", str(out)]
    monkeypatch.setattr(runner, "ray_or_none", lambda: None)
    _one_line_error(capsys, base + ["--workers", "2"], "--workers 2 runs on Ray, which is not installed",
                    "pip install 'vlmrt[batch]'")
    _one_line_error(capsys, base + ["--workers", "0"], "--workers must be >= 1")
    _one_line_error(capsys, base + ["--allow-local-urls", "--no-image-urls"],  # (main 62241fa took both: no URLs)
                    "--allow-local-urls and --no-image-urls contradict each other")
    _one_line_error(capsys, base, "is not a vlmrt bundle")
    _one_line_error(capsys, ["batch", str(tmp_path), "--input", str(tmp_path / "x"), "--output", str(out)],
                    "no such file or folder")
    assert not out.exists()
    _one_line_error(capsys, base[:-1] + [str(tmp_path)], "is a folder")
    out.write_text("not ours\n")
    _one_line_error(capsys, base, "line 1 is not a vlmrt batch line")
    assert out.read_text() == "not ours\n"


# ---------------------------------------------------------------- the demo model: in process and on Ray

N_QUESTIONS = 24
OPTS = ["--max-new-tokens", "8"]
SHAPES = ["circle", "rectangle", "triangle"]
SHAPE = {"type": "json_schema", "json_schema": {"name": "shape", "strict": True, "schema": {  # (6 tokens: within 8)
    "type": "object", "properties": {"shape": {"enum": SHAPES}}, "required": ["shape"], "additionalProperties": False}}}


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def actor_pids() -> list[int]:
    """This process's Ray Data actors running the batch worker (process title ray::MapWorker(MapBatches(Answerer)))."""
    pids = []
    for p in _descendants(os.getpid()):
        try:
            if b"MapBatches(Answerer)" in Path(f"/proc/{p}/cmdline").read_bytes():
                pids.append(p)
        except OSError:
            pass
    return sorted(pids)


@pytest.fixture(scope="module")
def job(demo_model, tmp_path_factory):
    """A JSONL of every record shape over easy-VQA test images (a loopback server serves the URL one), and each
    record's reference: a fresh VLM's generate (cache-less), or chat after reset for the conversation."""
    pytest.importorskip("easy_vqa")
    from http_images import serve_images
    from vlmrt.demo import easyvqa_data as ev
    from vlmrt.runtime.vlm import VLM

    bundle = demo_model[1]
    tmp = tmp_path_factory.mktemp("batch")
    rows = ev.select("test", N_QUESTIONS)
    img = [str(ev.image_path("test", i)) for _, _, i in rows[:3]]
    (tmp / "imgs").mkdir()
    (tmp / "imgs" / "rel.png").write_bytes(Path(img[2]).read_bytes())
    uri = "data:image/png;base64," + base64.b64encode(Path(img[1]).read_bytes()).decode()
    conv = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "imgs/rel.png"}},
                                         {"type": "text", "text": "what shape is in the image?"}]},
            {"role": "assistant", "content": "circle"},
            {"role": "user", "content": "what color is the shape?"}]
    with serve_images({"/q.png": Path(img[0]).read_bytes()}, lifetime_s=900) as base:
        lines = [{"id": f"q{k}", "image": str(ev.image_path("test", i)), "prompt": q} for k, (q, _, i) in enumerate(rows)]
        lines += [{"id": "url", "image": base + "/q.png", "prompt": "what color is the shape?"},
                  {"id": "datauri", "image": uri, "prompt": "what shape is in the image?"},
                  {"id": "relative", "image": "imgs/rel.png", "prompt": "is there a blue shape?"},
                  {"id": 2, "image": [img[0], img[1]], "prompt": "what color is the shape?"},
                  {"id": "conversation", "messages": conv},
                  {"id": "schema", "image": img[1], "prompt": "what shape is in the image?", "response_format": SHAPE},
                  {"id": "missing", "image": "imgs/none.png", "prompt": "what?"},
                  b'{"id": "torn", "image": ']
        src = _jsonl(tmp / "questions.jsonl", lines)
        vlm = VLM.load(bundle)
        ref = {}
        for r in lines[:-2]:
            if "messages" in r:
                vlm.reset()
                msgs = json.loads(json.dumps(r["messages"]).replace('"imgs/rel.png"', json.dumps(str(tmp / "imgs/rel.png"))))
                for _ in vlm.chat(msgs, max_new_tokens=8):
                    pass
            else:
                ims = r["image"] if isinstance(r["image"], list) else [r["image"]]
                vlm(r["prompt"], images=[str(tmp / s) if s.startswith("imgs/") else s for s in ims], max_new_tokens=8,
                    response_format=r.get("response_format"))
            ref[records.id_key(r["id"])] = (vlm.result.text, vlm.result.token_ids)
        errors = {'"missing"': f"image not found: {tmp / 'imgs' / 'none.png'}",
                  f'"line-{len(lines)}"': f"line {len(lines)}: not JSON (Expecting value)"}
        yield dict(bundle=str(bundle), src=src, tmp=tmp, ref=ref, errors=errors, url=base + "/q.png", conv=conv)


def _out(path: Path) -> dict:
    lines = [json.loads(ln) for ln in path.read_text().splitlines()]
    by = {records.id_key(d["id"]): d for d in lines}
    assert len(by) == len(lines), "an id written twice"
    return by


def _check(job, out: Path) -> dict:
    """OUT holds every record once: the reference's answer for each askable one, the expected error for the rest."""
    by = _out(out)
    assert set(by) == set(job["ref"]) | set(job["errors"])
    for key, (text, ids) in job["ref"].items():
        assert (by[key]["text"], by[key]["token_ids"]) == (text, ids), key
        assert by[key]["stats"]["generated_tokens"] == len(ids)
    assert {k: by[k]["error"] for k in job["errors"]} == job["errors"]
    # the record with its own schema: a complete answer held to it, its value beside the text
    held = by['"schema"']
    assert held["stats"]["stop_reason"] == "grammar" and held["json"] == json.loads(held["text"])
    assert set(held["json"]) == {"shape"} and held["json"]["shape"] in SHAPES
    return by


def _batch(capsys, argv) -> tuple[dict, str]:
    assert cli.main(["batch", *argv, *OPTS, "--allow-local-urls", "--json"]) == 0  # the job's URL is on loopback
    o, e = capsys.readouterr()
    return json.loads(o.strip().splitlines()[-1]), e


def test_answers_equal_vlmrt_run(job, capsys):
    """The reference used by the batch tests is `vlmrt run --json` itself (a URL record and the conversation)."""
    conv = job["tmp"] / "conv.json"
    conv.write_text(json.dumps(job["conv"]).replace('"imgs/rel.png"', json.dumps(str(job["tmp"] / "imgs/rel.png"))))
    for argv, key in ((["--image", job["url"], "--prompt", "what color is the shape?"], '"url"'),
                      (["--messages", str(conv)], '"conversation"')):
        assert cli.main(["run", job["bundle"], *argv, *OPTS, "--json"]) == 0
        r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert (r["text"], r["token_ids"]) == job["ref"][key]
    assert {t for t, _ in job["ref"].values()} >= {" green", " circle"}  # real answers, not a constant


def test_in_process_batch_resumes(job, capsys, tmp_path, monkeypatch):
    """--workers 1 without Ray: every record once, as `vlmrt run` answers it; a rerun skips them all; a torn last
    line (a killed run) is dropped and that record done again; --retry-errors does the error lines again."""
    monkeypatch.setattr(runner, "ray_or_none", lambda: pytest.fail("the in-process path looked for Ray"))
    out = tmp_path / "answers.jsonl"
    total = len(job["ref"]) + len(job["errors"])
    s, err = _batch(capsys, [job["bundle"], "--input", str(job["src"]), "--output", str(out)])
    assert (s["answered"], s["errors"], s["skipped"], s["engine"]) == (len(job["ref"]), 2, 0, "in-process")
    assert f"] {total - 1}/{total - 1} records" in err and "vlmrt batch: " in err.splitlines()[-1]  # the bad line
    assert 0 < s["first_result_s"] < s["seconds"] and s["steady_records_per_s"] > 0
    _check(job, out)
    before = out.read_bytes()
    s, _ = _batch(capsys, [job["bundle"], "--input", str(job["src"]), "--output", str(out)])
    assert (s["answered"], s["errors"], s["skipped"]) == (0, 0, total) and out.read_bytes() == before
    lines = before.split(b"\n")[:-1]
    last = json.loads(lines[-1])
    out.write_bytes(b"".join(ln + b"\n" for ln in lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    s, err = _batch(capsys, [job["bundle"], "--input", str(job["src"]), "--output", str(out)])
    assert "ended in a partial line" in err and s["answered"] + s["errors"] == 1 and s["skipped"] == total - 1
    redone = _check(job, out)[records.id_key(last["id"])]
    # (the answer, not its timings: records finish in any order when they decode together, the last line may be any's)
    assert {k: v for k, v in redone.items() if k != "stats"} == {k: v for k, v in last.items() if k != "stats"}
    s, _ = _batch(capsys, [job["bundle"], "--input", str(job["src"]), "--output", str(out), "--retry-errors"])
    assert (s["answered"], s["errors"], s["skipped"]) == (0, 2, total - 2)
    _check(job, out)
    # a resume with options that change answers is refused, OUT and its options record left as they were
    before, side = out.read_bytes(), out.with_name(out.name + ".options.json")
    recorded = side.read_bytes()
    assert json.loads(recorded)["max_new_tokens"] == 8
    assert cli.main(["batch", job["bundle"], "--input", str(job["src"]), "--output", str(out),
                     "--max-new-tokens", "9"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"vlmrt: error: --output {out} holds answers made with other options (max_new_tokens 8 then, 9 "
                   "now): rerun with the same options, or give another --output"), err
    assert out.read_bytes() == before and side.read_bytes() == recorded


def test_two_ray_workers_one_killed(job, capsys, tmp_path):
    """--workers 2 on a local Ray started by the job: 2 actors, each loading the bundle once; one actor's process is
    killed after some records. Every record is in OUT exactly once with `vlmrt run`'s answer."""
    pytest.importorskip("ray")
    out = tmp_path / "answers.jsonl"
    killed: list[int] = []

    def kill_one():
        t = time.monotonic()
        while time.monotonic() - t < 300 and not killed:
            if out.exists() and out.read_bytes().count(b"\n") >= 12:
                pids = actor_pids()
                if len(pids) == 2:
                    os.kill(pids[0], signal.SIGKILL)
                    killed.append(pids[0])
            time.sleep(0.05)

    th = threading.Thread(target=kill_one, daemon=True)
    th.start()
    s, err = _batch(capsys, [job["bundle"], "--input", str(job["src"]), "--output", str(out), "--workers", "2",
                             "--threads", "1", "--quiet"])
    th.join(timeout=1)
    assert killed, "no actor was killed: the run ended first"
    assert (s["answered"], s["errors"], s["engine"], s["threads"]) == (len(job["ref"]), 2, "ray", 1)
    by = _check(job, out)
    loads = {d["stats"]["load_s"] for d in by.values() if "stats" in d}
    assert 2 <= len(loads) <= 3, loads  # two actors + the killed one's replacement: a load per actor, not per batch
    t = time.monotonic()
    while actor_pids() and time.monotonic() - t < 30:
        time.sleep(0.2)
    assert not actor_pids()  # the job's Ray is shut down
