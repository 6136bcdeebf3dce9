"""The input of `vlmrt batch`: a folder of images, or a JSONL file of records, read into requests.

    {"id": "a1", "image": "imgs/cat.png", "prompt": "What is this?"}
    {"id": "a2", "image": ["https://host/a.jpg", "data:image/png;base64,..."], "prompt": "Compare them."}
    {"id": "v1", "video": "clips/run.mp4", "prompt": "What happens?"}     (+ "fps" for a folder of frames)
    {"id": "a3", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "b.png"}},
                                                          {"type": "text", "text": "And this?"}]}]}
    {"id": "r1", "image": "receipt.png", "prompt": "The total?", "response_format": {"type": "json_schema",
                                                                                    "json_schema": {"schema": {...}}}}

Each record becomes one request, `{"id", "messages"}` (OpenAI-style messages, what VLM.chat answers; with the
record's `response_format`, OpenAI's, the answer held to it: runtime/decode/grammar.py), or, when it
cannot be asked (not JSON, no id, a duplicate id, both `prompt` and `messages`, bad messages, a response_format that
is not one), an error: the job
writes that record's error line and goes on. A record without `prompt` or `messages` takes `--prompt`. A folder is
every image file in it and below, in path order, its id the path relative to the folder. Relative image paths
in a JSONL file are relative to that file's folder. Keys left out above (an expected answer, metadata) are ignored.
Image files are read by the worker that answers the record, not here (on a cluster, a path must be readable on
every node). Ids `line-N` stand for records that have no usable id of their own.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..runtime.decode.grammar import GrammarError, GrammarSpec
from ..runtime.prompt.conversation import ConversationError, is_unicode, parse_messages, user_turn

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif", ".tiff"}
_NOT_A_PATH = re.compile(r"(?i)([a-z][a-z0-9+.-]*://|data:)")


class InputError(ValueError):
    """The input as a whole cannot be read (the job does not start)."""


@dataclass
class Record:
    id: str | int
    messages: list | None = None  # the request; None when error is set
    error: str | None = None  # why this record cannot be asked
    response_format: dict | None = None  # the record's own (OpenAI's response_format), None: the job's

    @property
    def key(self) -> str:
        """The resume key: the id's JSON text (1 and "1" are different ids)."""
        return id_key(self.id)

    def request(self) -> str:
        """What a worker gets: {"id", "messages"} (and the record's response_format) as JSON text."""
        fmt = {} if self.response_format is None else {"response_format": self.response_format}
        return json.dumps({"id": self.id, "messages": self.messages, **fmt}, ensure_ascii=False)


def id_key(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def read_records(src: str | Path, prompt: str | None) -> list[Record]:
    """The records of a folder of images or a JSONL file; prompt: the default question (--prompt)."""
    p = Path(src)
    if p.is_dir():
        return folder_records(p, prompt)
    if p.is_file():
        return jsonl_records(p, prompt)
    raise InputError(f"--input {src}: no such file or folder")


def folder_records(folder: Path, prompt: str | None) -> list[Record]:
    if prompt is None:
        raise InputError("a folder --input needs --prompt (the question asked about every image)")
    files = sorted(f for f in folder.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES and f.is_file()
                   and not any(part.startswith(".") for part in f.relative_to(folder).parts))
    if not files:
        raise InputError(f"--input {folder}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))}) in it")
    return [Record(f.relative_to(folder).as_posix(), user_turn(prompt, [str(f.resolve())])) for f in files]


def jsonl_records(path: Path, prompt: str | None) -> list[Record]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise InputError(f"cannot read --input {path}: {e.strerror or e}") from None
    base = path.resolve().parent
    out: list[Record] = []
    first: dict[str, int] = {}  # id key -> line number
    for n, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        rec = parse_line(line, n, base, prompt)
        if rec.key in first:
            rec = Record(f"line-{n}", error=f"line {n}: duplicate id {rec.key} (first on line {first[rec.key]})")
        first.setdefault(rec.key, n)
        out.append(rec)
    if not out:
        raise InputError(f"--input {path}: no records in it")
    return out


def parse_line(line: bytes, n: int, base: Path, prompt: str | None) -> Record:
    """One JSONL line -> a Record (with error set when it cannot be asked)."""
    try:
        obj = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return Record(f"line-{n}", error=f"line {n}: not UTF-8")
    except json.JSONDecodeError as e:
        return Record(f"line-{n}", error=f"line {n}: not JSON ({e.msg})")
    except RecursionError:
        return Record(f"line-{n}", error=f"line {n}: not JSON (nested too deeply)")
    except ValueError as e:  # an integer of more than 4300 digits
        return Record(f"line-{n}", error=f"line {n}: not JSON ({e})")
    if not isinstance(obj, dict):
        return Record(f"line-{n}", error=f"line {n}: a record must be a JSON object")
    rid = obj.get("id")
    surrogate = isinstance(rid, str) and not is_unicode(rid)  # OUT could not hold it
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "" or surrogate:
        return Record(f"line-{n}", error=f"line {n}: a record needs an id (a non-empty string or an integer)"
                      + ("; this one holds a lone surrogate" if surrogate else ""))
    try:
        fmt = obj.get("response_format")
        GrammarSpec.from_response_format(fmt)  # (its shape; the schema is compiled by the worker)
        return Record(rid, request_messages(obj, base, prompt), response_format=fmt)
    except (ConversationError, GrammarError) as e:
        return Record(rid, error=str(e))
    except RecursionError:  # messages nested within the parser's depth but past copy's
        return Record(rid, error="messages are nested too deeply")


def request_messages(obj: dict, base: Path, prompt: str | None) -> list[dict]:
    """The record's messages: its own (`messages`) or one user turn of its images and prompt."""
    if "messages" in obj:
        if "prompt" in obj or "image" in obj or "video" in obj:
            raise ConversationError("a record has either messages or prompt (+ image / video), not both")
        messages = copy.deepcopy(obj["messages"])
        parse_messages(messages)  # checked here: a bad conversation is this record's error
        for m in messages:
            for part in m["content"] if isinstance(m["content"], list) else []:
                _resolve_part(part, base)
        return messages
    text = obj.get("prompt", prompt)
    if text is None:
        raise ConversationError("the record has no prompt (nor messages) and no --prompt was given")
    if not isinstance(text, str):
        raise ConversationError("prompt must be a string")
    images = obj.get("image", [])
    images = [images] if isinstance(images, str) else images
    if not isinstance(images, list) or not all(isinstance(s, str) and s for s in images):
        raise ConversationError("image must be a path, an http(s) URL or a data URI, or a list of them")
    video = obj.get("video")
    if video is not None and not (isinstance(video, str) and video):
        raise ConversationError("video must be a path (a file or a folder of frames), an http(s) URL or a data URI")
    if "fps" in obj and video is None:
        raise ConversationError("fps is the frame rate of the record's video (a folder of frames)")
    videos = [{"type": "video", "video": resolve(video, base), "fps": obj.get("fps")}] if video is not None else []
    messages = user_turn(text, [resolve(s, base) for s in images])
    messages[0]["content"][:0] = videos
    parse_messages(messages)  # the text's checks (a lone surrogate) are this record's error, as for messages
    return messages


def resolve(src: str, base: Path) -> str:
    """A relative image path made absolute against base; URLs and data URIs as they are."""
    if _NOT_A_PATH.match(src) or Path(src).is_absolute():
        return src
    return str(base / src)


def _resolve_part(part: dict, base: Path) -> None:
    kind = part.get("type")
    if kind in ("image_url", "video_url"):
        u = part[kind]
        if isinstance(u, dict):
            u["url"] = resolve(u["url"], base)
        else:
            part[kind] = resolve(u, base)
    elif kind in ("image", "video"):
        for k in ("image", "video", "url", "path"):
            if isinstance(part.get(k), str):
                part[k] = resolve(part[k], base)
                break
