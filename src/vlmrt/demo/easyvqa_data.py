"""easy-VQA (PyPI ``easy-vqa``, MIT): the data, the prompt format of the shipped demo model and
exact-match scoring. Stdlib + numpy + Pillow only (the runtime side may import it).

The dataset: 64x64 RGB images of one coloured shape, questions.json = [[question, answer, image_id]],
13 answers (8 colours, 3 shapes, yes/no). 4000 train images / 38,575 questions, 1000 test images /
9,673 questions.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

COLORS = ("red", "green", "blue", "black", "gray", "teal", "brown", "yellow")
SHAPES = ("circle", "rectangle", "triangle")
ANSWERS = COLORS + SHAPES + ("yes", "no")
INSTALL_HINT = "pip install easy-vqa==1.0"

# The prompt the exported bundle builds for one 64 px image with the SmolVLM chat template
# (runtime/prompt/build.py grid_markers with rows == cols == 0): what training feeds the decoder.
FAKE, GLOBAL, IMAGE, EOU = "<fake_token_around_image>", "<global-img>", "<image>", "<end_of_utterance>"


class EasyVQAError(ValueError):
    pass


TOKENS_PER_TILE = 4  # preset "easyvqa": (64 px / patch 8)^2 / scale 4^2


def prompt_text(question: str, tokens_per_tile: int = TOKENS_PER_TILE) -> str:
    """'<|im_start|>User:<fake><global-img><image>x4<fake>{question}<end_of_utterance>\\nAssistant:'"""
    return f"<|im_start|>User:{FAKE}{GLOBAL}{IMAGE * tokens_per_tile}{FAKE}{question}{EOU}\nAssistant:"


IM_END = "<|im_end|>"  # SmolLM2-Instruct's own end of turn (an EOS of the checkpoint, as <end_of_utterance>)


def answer_text(answer: str) -> str:
    """What the model is trained to say after 'Assistant:' -- one word, then the end of the turn. The
    turn ends with the decoder's own <|im_end|>: the frozen decoder already predicts it after an answer,
    while SmolVLM's added <end_of_utterance> row (an average embedding) is hard to reach from a LoRA."""
    return f" {answer}{IM_END}"


def data_dir() -> Path:
    try:
        import easy_vqa
    except ImportError:
        raise EasyVQAError(f"the easy-VQA data set is not installed ({INSTALL_HINT})") from None
    return Path(easy_vqa.__file__).parent / "data"


def load_split(split: str) -> list[tuple[str, str, int]]:
    """[(question, answer, image_id)] of 'train' or 'test', in the file's order."""
    if split not in ("train", "test"):
        raise EasyVQAError(f"unknown easy-VQA split {split!r} (train|test)")
    return [(q, a, int(i)) for q, a, i in json.loads((data_dir() / split / "questions.json").read_text())]


def image_path(split: str, image_id: int) -> Path:
    return data_dir() / split / "images" / f"{image_id}.png"


_WORD = re.compile(r"[a-z]+")


def normalize_answer(text: str) -> str:
    """The answer word of a generated text, for exact match: lower-case, keep letters only, and take
    the LAST word of the text that is one of the 13 answers ("The shape is a green circle." asked for
    a colour would be ambiguous, so only the last answer word counts: 'circle'); '' when none is.
    A one-word answer ("Green.", " yes") is that word."""
    words = [w for w in _WORD.findall(text.lower()) if w in ANSWERS]
    return words[-1] if words else ""


def stratified_subset(rows: list[tuple[str, str, int]], n: int, seed: int = 0) -> list[int]:
    """Indices of a fixed subset of ``n`` questions, stratified by answer: round-robin over the 13
    answers (each answer's questions in a seeded random order), so every answer is as equally
    represented as the data allow; returned in ascending order. Deterministic for (rows, n, seed)."""
    by_answer: dict[str, list[int]] = defaultdict(list)
    for i, (_, a, _) in enumerate(rows):
        by_answer[a].append(i)
    rng = np.random.default_rng(seed)
    queues = {a: list(rng.permutation(idx)) for a, idx in sorted(by_answer.items())}
    out: list[int] = []
    while len(out) < min(n, len(rows)):
        for a in sorted(queues):
            if queues[a] and len(out) < n:
                out.append(int(queues[a].pop(0)))
    return sorted(out)


def image_labels(rows: list[tuple[str, str, int]]) -> dict[int, tuple[int, int]]:
    """Per image: (colour index, shape index) read off its questions and answers (-1 when unknown).
    'what color is the circle?' -> 'blue' gives both; 'is there a red shape?' -> 'yes' gives red."""
    lab: dict[int, list[int]] = defaultdict(lambda: [-1, -1])
    for q, a, i in rows:
        words = _WORD.findall(q.lower())
        neg = "not" in words or "no" in words
        if a in COLORS:
            lab[i][0] = COLORS.index(a)
        if a in SHAPES:
            lab[i][1] = SHAPES.index(a)
        for w in words:
            said = (a == "yes") != neg  # the question's claim holds
            if w in COLORS and (a in SHAPES or (a in ("yes", "no") and said)):
                lab[i][0] = COLORS.index(w)
            if w in SHAPES and (a in COLORS or (a in ("yes", "no") and said)):
                lab[i][1] = SHAPES.index(w)
    return {i: (c, s) for i, (c, s) in lab.items()}


DEFAULT_LIMIT = 260  # 20 questions per answer (stratified_subset, seed 0)


def select(split: str = "test", limit: int | None = DEFAULT_LIMIT, seed: int = 0) -> list[tuple[str, str, int]]:
    """The scored questions: all of the split (limit 0/None) or the fixed stratified subset."""
    rows = load_split(split)
    if not limit or limit >= len(rows):
        return rows
    if limit < 0:
        raise ValueError("--limit must be >= 0")
    return [rows[i] for i in stratified_subset(rows, limit, seed)]


def score(answer_fn, rows: list[tuple[str, str, int]], split: str = "test", progress: bool = False) -> dict:
    """Exact match of ``answer_fn(image_path, question) -> generated text`` on ``rows``: the
    normalized answer word (normalize_answer) must equal the data set's answer. Returns accuracy
    overall, per answer group (colour / shape / yes-no), and every prediction."""
    import sys
    import time

    preds, ok = [], 0
    groups = {"colour": [0, 0], "shape": [0, 0], "yes/no": [0, 0]}
    t0 = time.perf_counter()
    for n, (q, a, i) in enumerate(rows, 1):
        text = answer_fn(image_path(split, i), q)
        hit = normalize_answer(text) == a
        ok += hit
        g = groups["colour" if a in COLORS else "shape" if a in SHAPES else "yes/no"]
        g[0] += hit
        g[1] += 1
        preds.append({"question": q, "image": i, "answer": a, "text": text, "correct": bool(hit)})
        if progress and (n % 20 == 0 or n == len(rows)):
            print(f"\r{n}/{len(rows)} questions, exact match {ok / n:.4f}", end="" if n < len(rows) else "\n",
                  file=sys.stderr, flush=True)
    return {
        "split": split, "questions": len(rows), "correct": ok, "accuracy": ok / max(1, len(rows)),
        "by_group": {k: (c / t if t else None) for k, (c, t) in groups.items()},
        "seconds": round(time.perf_counter() - t0, 1), "predictions": preds,
    }
