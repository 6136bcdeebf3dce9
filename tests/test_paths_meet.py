"""Where features meet, through the Python API on the tiny SmolVLM fixture (CASES[0]): an answer closed mid-way or a
prefill interrupted mid-way and then a follow-up on the same VLM, accepted lookahead drafts (an oracle drafter that
knows plain decoding's answer) followed by a reused follow-up or ended by a stop string inside an accepted block,
lookahead with sampling, and the vision graph file altered between VLM.load and the first image. Every answer is
compared, text and token ids, with a fresh VLM's run of the same conversation."""

from __future__ import annotations

import shutil
import sys

import numpy as np
import pytest
from PIL import Image

from session_hooks import DecoderCallHook
from vlmrt.format import manifest as mf
from vlmrt.runtime.bundle import Bundle
from vlmrt.runtime.vlm import VLM
from vlmrt.runtime.decode import lookahead as lookahead_module


def picture(i: int, w: int = 96) -> Image.Image:
    """A distinct image per i (on the fixture: a 1x2 or 1x3 tile grid + the global tile)."""
    rng = np.random.default_rng(100 + i)
    return Image.fromarray(rng.integers(0, 256, (20 + 3 * i, w, 3), dtype=np.uint8))


def user(text: str, *images) -> dict:
    return {"role": "user", "content": [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]}


def run(vlm: VLM, messages, **kw) -> tuple[str, list[int]]:
    text = "".join(vlm.chat(messages, **kw))
    assert text == vlm.result.text
    return text, list(vlm.result.token_ids)


def fresh(ref: VLM, messages, **kw) -> tuple[str, list[int]]:
    """The answer of a fresh run of the whole conversation (nothing kept from other calls)."""
    ref.reset()
    return run(ref, messages, **kw)


@pytest.fixture
def tiny(default_bundle):
    return default_bundle.bundle


@pytest.fixture
def ref(tiny):
    return VLM.load(tiny)


# ------------------------------------------------------------------------- cancel, then follow up


@pytest.mark.parametrize("mode", ["hybrid", "kv"])
def test_answer_closed_mid_way_then_follow_ups_equal_fresh_runs(tiny, ref, mode):
    """chat() closed after a few pieces (a client that goes away mid-answer), then on the same VLM: the same question
    again, the partial answer kept as the assistant turn + a question, and another conversation: each answer is a
    fresh run's, and the first two reuse the rows the closed answer left."""
    vlm = VLM.load(tiny)
    kw = dict(mode=mode, max_new_tokens=24, ignore_eos=True)
    first = [{"role": "system", "content": "Be brief."}, user("Describe the two pictures.", picture(1), picture(2))]
    gen = vlm.chat(first, **kw)
    partial = "".join(next(gen) for _ in range(5))
    gen.close()
    assert 0 < len(vlm.result.token_ids) < 24
    follow_ups = [first, first + [{"role": "assistant", "content": partial}, user("And the second one?")],
                  [user("Something else entirely.", picture(3))]]
    for i, messages in enumerate(follow_ups):
        assert run(vlm, messages, **kw) == fresh(ref, messages, **kw), i
        if i < 2:
            assert vlm.result.stats.reused_prompt_tokens > 0, i
    # the closed answer itself was a prefix of the full one
    assert fresh(ref, first, **kw)[0].startswith(partial)


class Interrupting(DecoderCallHook):
    """A bundle's sessions whose decoder graph calls raise KeyboardInterrupt on the n-th call once armed (Ctrl-C, or
    any failure, in the middle of a prefill)."""

    def __init__(self, sessions):
        super().__init__(sessions)
        self.left = None

    def arm(self, n: int) -> None:
        self.left = n

    def tick(self):
        if self.left is not None:
            self.left -= 1
            if self.left == 0:
                self.left = None
                raise KeyboardInterrupt


@pytest.mark.parametrize("mode", ["hybrid", "kv"])
def test_prefill_interrupted_mid_way_then_follow_ups_equal_fresh_runs(tiny, ref, mode):
    """A conversation is answered (its rows recorded), then a long two-image prompt of another conversation is
    interrupted in the middle of its prefill (it overwrote some of those rows): the first conversation's follow-up,
    the interrupted prompt again and a third one are each a fresh run's answer."""
    b = Bundle.open(tiny)
    sessions = b.sessions = Interrupting(b.sessions)
    vlm = VLM(b)
    kw = dict(mode=mode, max_new_tokens=12, ignore_eos=True)
    first = [user("What is in the picture?", picture(4))]
    a = run(vlm, first, **kw)
    long = [user("Compare these two pictures in detail, please.", picture(5, 160), picture(6, 160))]
    fresh(ref, long, **{**kw, "max_new_tokens": 1})
    n_prompt = ref.result.stats.prompt_tokens
    assert n_prompt > 100
    calls = n_prompt // (8 if mode == "hybrid" else 1)
    sessions.arm(calls // 2)  # the middle of the prefill
    with pytest.raises(KeyboardInterrupt):
        list(vlm.chat(long, **kw))
    assert vlm.result.token_ids == []
    follow = first + [{"role": "assistant", "content": a[0]}, user("And its colours?")]
    for messages in (follow, long, [user("Hello.")]):
        assert run(vlm, messages, **kw) == fresh(ref, messages, **kw)


# ------------------------------------------------------------------------- accepted drafts (an oracle drafter)


class Oracle:
    """A drafter (PromptLookup's interface) that knows plain decoding's answer to each prompt: it proposes the true
    next tokens, every third call with one wrong token among them (a partly accepted block), so that verify calls
    accept several drafts at once. Prompts it does not know get no drafts."""

    answers: dict[tuple, list[int]] = {}
    vocab = 0

    def __init__(self, k: int, ids: list[int], adapt: bool = True):
        self.k, self.ids, self.n, self.calls = k, list(ids), len(ids), 0
        self.answer = self.answers.get(tuple(ids))

    def append(self, token):
        self.ids.append(int(token))

    def propose(self, limit: int) -> list[int]:
        if self.answer is None:
            return []
        at = len(self.ids) - self.n
        out = self.answer[at : at + min(self.k, limit)]
        self.calls += 1
        if self.calls % 3 == 0 and len(out) > 1:  # a wrong draft: the block is accepted up to it
            j = self.calls % len(out)
            out = out[:j] + [(out[j] + 1) % self.vocab]
        return out

    def feedback(self, accepted: int, drafted: int) -> None:
        pass


@pytest.fixture
def oracle(monkeypatch):
    """Oracle in place of PromptLookup wherever the runtime imported it."""
    Oracle.answers = {}
    patched = [m for m in list(sys.modules.values()) if getattr(m, "__name__", "").startswith("vlmrt.")
               and getattr(m, "PromptLookup", None) is lookahead_module.PromptLookup]
    assert patched
    for m in patched:
        monkeypatch.setattr(m, "PromptLookup", Oracle)
    return Oracle


def teach(oracle, ref: VLM, messages, **kw) -> tuple[str, list[int]]:
    """Plain decoding's answer of a fresh run, taught to the oracle."""
    want = fresh(ref, messages, **kw)
    oracle.answers[tuple(ref.result.prompt_ids)] = want[1]
    oracle.vocab = ref.manifest.decoder.vocab_size
    return want


@pytest.mark.parametrize("mode", ["hybrid", "kv"])
def test_accepted_drafts_then_a_reused_follow_up_equal_plain_decoding(tiny, ref, oracle, mode):
    """Lookahead with drafts accepted several at a time (several KV rows per verify call), then a follow-up that
    reuses the recorded rows, then the first question again: text and ids of plain decoding (fresh runs)."""
    fast = VLM.load(tiny, lookahead=4)
    kw = dict(mode=mode, max_new_tokens=30, ignore_eos=True)
    first = [user("Describe the picture.", picture(7))]
    want = teach(oracle, ref, first, **kw)
    assert run(fast, first, **kw) == want
    st = fast.result.stats
    assert st.accepted_tokens >= 15 and st.drafted_tokens > st.accepted_tokens  # many accepted, some rejected
    follow = first + [{"role": "assistant", "content": want[0]}, user("What else?")]
    want2 = teach(oracle, ref, follow, **kw)
    assert run(fast, follow, **kw) == want2
    assert fast.result.stats.reused_prompt_tokens > 0 and fast.result.stats.accepted_tokens >= 15
    assert run(fast, first, **kw) == want


@pytest.mark.parametrize("at", [6, 11])
def test_a_stop_string_inside_an_accepted_block_equals_plain_decoding(tiny, ref, oracle, at):
    """A stop string that the text reaches in the middle of a block of accepted drafts: the answer ends where plain
    decoding's ends (text, ids, stop reason), and a follow-up after it is a fresh run's."""
    fast = VLM.load(tiny, lookahead=4)
    kw = dict(max_new_tokens=30, ignore_eos=True)
    first = [user("What is in the picture?", picture(8))]
    _, ids = teach(oracle, ref, first, **kw)
    tok = ref.bundle.tokenizer
    # a stop string: the text of two tokens from `at` on, where it first occurs there (not earlier in the answer)
    text = tok.decode(ids, skip_special_tokens=True)
    stop = tok.decode(ids[at : at + 2], skip_special_tokens=True)
    before = tok.decode(ids[:at], skip_special_tokens=True)
    assert stop.strip() and text.find(stop) == len(before), (stop, text)
    want = fresh(ref, first, stop=[stop], **kw)
    assert ref.result.stats.stop_reason == "stop" and want[0] == before and len(want[1]) < 30
    got = run(fast, first, stop=[stop], **kw)
    assert got == want and fast.result.stats.stop_reason == "stop"
    assert fast.result.stats.accepted_tokens >= 3
    follow = first + [{"role": "assistant", "content": want[0]}, user("Go on.")]
    assert run(fast, follow, **kw) == fresh(ref, follow, **kw)


def test_lookahead_with_sampling_equals_plain_sampling(tiny, ref, oracle):
    """Sampled answers (temperature, top-k, top-p, a seed) of a VLM loaded with lookahead are those of a plain VLM
    with the same seed, even with a drafter that knows the answer."""
    fast = VLM.load(tiny, lookahead=4)
    for i, sampling in enumerate([dict(temperature=0.8, seed=3), dict(temperature=1.2, top_k=40, top_p=0.9, seed=11)]):
        messages = [user(f"Tell me about picture {i}.", picture(9 + i))]
        kw = dict(max_new_tokens=24, ignore_eos=True, **sampling)
        want = teach(oracle, ref, messages, **kw)
        assert len(set(want[1])) > 5  # sampled noise, not a constant
        assert run(fast, messages, **kw) == want
        greedy = fresh(ref, messages, max_new_tokens=24, ignore_eos=True)
        assert greedy != want


# ------------------------------------------------------------------------- the vision graph, loaded lazily


def test_vision_graph_altered_after_load_is_refused_at_its_first_use(tiny, tmp_path):
    """The vision session loads on the first image; a vision graph file (or its weights) altered between VLM.load
    and that image is refused in one line (BundleError), and a file rewritten with the same bytes still answers."""
    img = picture(1)
    for name in ("vision.onnx", "vision.data"):
        b = tmp_path / name.replace(".", "_")
        shutil.copytree(tiny, b)
        vlm = VLM.load(b)
        want = vlm("What is this?", img, max_new_tokens=4, ignore_eos=True).token_ids
        vlm = VLM.load(b)
        p = b / name
        p.write_bytes(p.read_bytes())  # the same bytes: a new mtime, the same sha256
        assert vlm("What is this?", img, max_new_tokens=4, ignore_eos=True).token_ids == want
        vlm = VLM.load(b)
        assert vlm("Hi", max_new_tokens=2).token_ids  # text only: the vision graph is not loaded yet
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0x01  # one bit of a weight (or of the graph's protobuf)
        p.write_bytes(bytes(data))
        with pytest.raises(mf.BundleError, match="altered") as e:
            vlm("What is this?", img, max_new_tokens=4)
        assert "\n" not in str(e.value) and name in str(e.value)
