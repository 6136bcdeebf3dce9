"""Grammar-constrained decoding (runtime/decode/grammar.py, llguidance) on the tiny exported bundle: constrained and
free sequences decoding in one round answer as each does alone; lookahead drafts checked against the grammar and
the grammar rolled back after rejected drafts (the same ids as without lookahead); a complete grammar stops the
answer ("grammar": finish_reason stop), max_new_tokens first leaves it partial ("length"); the greedy choice under
a mask is over every allowed token (the graph's argmax taken only where allowed: the re-scored head's case); bad
grammars as one line naming the field; `vlmrt run --json-schema` with a bad file is one line and exit status 1."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest

from fixtures_tiny import alone, tiny  # noqa: F401  (fixtures)
from vlmrt.runtime.bundle import Bundle
from vlmrt.runtime.decode import lookahead
from vlmrt.runtime.decode.grammar import Constraint, GrammarError, GrammarSpec
from vlmrt.runtime.decode.sampler import Sampler, SamplingConfig
from vlmrt.runtime.decode.sequence import Sequence
from vlmrt.runtime.vlm import VLM

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}
JSON = GrammarSpec.json_schema(SCHEMA)
WORDS = GrammarSpec("regex", "(red|green|blue)( (red|green|blue)){2,5}")


def _prompt(vlm, n: int) -> list[int]:
    return np.random.default_rng(n).integers(0, vlm.manifest.decoder.vocab_size - 200, 3 + 7 * n).tolist()


def test_constrained_and_free_sequences_share_a_round_and_answer_as_alone(tiny, alone):
    """4 sequences in one scheduler: greedy JSON schema, seeded sampling under a regex, greedy free, sampled free;
    each answers what it answers alone, the constrained ones valid, ended by their grammar."""
    plan = [(JSON, SamplingConfig()), (WORDS, SamplingConfig(temperature=0.9, seed=3)), (None, SamplingConfig()),
            (None, SamplingConfig(temperature=0.8, top_k=20, seed=1))]
    s0 = alone.scheduler
    prompts = [_prompt(alone, i) for i in range(len(plan))]

    def constraint(vlm, spec):
        return None if spec is None else vlm.grammars.constraint(spec)

    want, why = [], []
    for p, (spec, s) in zip(prompts, plan):
        want.append(list(s0.generate(s0.embed(p), max_new_tokens=60, sampler=Sampler(s), ignore_eos=True,
                                     constraint=constraint(alone, spec))))
        why.append(s0.last.stop_reason)
    assert why[:2] == ["grammar", "grammar"] and why[2:] == ["length", "length"]
    vlms = VLM.slots(Bundle.open(tiny.bundle), len(plan))
    sched = vlms[0].scheduler
    seqs = [sched.add(Sequence(sched.embed(p), max_new_tokens=60, sampler=Sampler(s), ignore_eos=True,
                               constraint=constraint(vlms[0], spec)), i)
            for i, (p, (spec, s)) in enumerate(zip(prompts, plan))]
    while any(not s.done for s in seqs):
        sched.step()
    assert [s.ids for s in seqs] == want
    assert sched.widest >= 3  # they decoded together
    tok = alone.bundle.tokenizer
    obj = json.loads(tok.decode(want[0]))
    assert set(obj) == {"name", "n", "ok"} and isinstance(obj["ok"], bool)
    assert re.fullmatch(r"(red|green|blue)( (red|green|blue)){2,5}", tok.decode(want[1]))


def test_lookahead_drafts_are_checked_against_the_grammar_and_rolled_back(tiny, monkeypatch):
    """A prompt that the answer copies: drafts are proposed, some accepted and some rejected (the grammar rolled back
    each time), and the ids are those of plain constrained decoding."""
    monkeypatch.setattr(lookahead, "NGRAMS", (3, 2))
    monkeypatch.setattr(lookahead, "FIRST_PAUSE", 2)
    plain, fast = VLM.load(tiny.bundle), VLM.load(tiny.bundle, lookahead=4)
    rolled, orig = [], Constraint.rollback
    monkeypatch.setattr(Constraint, "rollback", lambda self, n: (rolled.append(n), orig(self, n))[1])
    spec = GrammarSpec("regex", "((red|green|blue) ){6,12}")
    drafted = accepted = 0
    for prompt in ("red green blue red green blue red green blue", "Say: blue blue red green blue red green",
                   "green red green red green red blue"):
        a = plain(prompt, max_new_tokens=48, response_format=spec)
        b = fast(prompt, max_new_tokens=48, response_format=spec)
        assert a.token_ids == b.token_ids and a.stats.stop_reason == b.stats.stop_reason in ("eos", "grammar")
        assert re.fullmatch(r"((red|green|blue) ){6,12}", b.text)
        drafted += b.stats.drafted_tokens
        accepted += b.stats.accepted_tokens
    assert accepted > 0 and drafted > accepted  # drafts taken, and some rejected
    assert any(n > 0 for n in rolled)  # the grammar was advanced by drafts and rolled back


def test_a_complete_grammar_stops_and_running_out_of_tokens_is_length(alone):
    done = alone("Describe it as JSON.", max_new_tokens=80, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}})
    assert done.stats.stop_reason == "grammar"
    obj = json.loads(done.text)
    assert list(obj) == ["name", "n", "ok"]  # the schema's property order, compact
    assert done.text == json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    cut = alone("Describe it as JSON.", max_new_tokens=4, response_format={"type": "json_object"})
    assert cut.stats.stop_reason == "length" and cut.stats.generated_tokens == 4
    assert cut.text.startswith("{") and done.text.startswith(cut.text[:1])
    with pytest.raises(ValueError):
        json.loads(cut.text)  # the partial text, as it is


class _Greedy:
    cfg = SamplingConfig()

    def __call__(self, logits):
        return int(np.argmax(logits))


def test_the_masked_greedy_choice_is_over_every_allowed_token(alone):
    """The re-scored 4-bit head's case: the graph's argmax (best of its re-scored top 8) is taken when the grammar
    allows it; when none of the 8 best is allowed the choice is the best allowed token outside them."""
    c = alone.grammars.constraint(GrammarSpec("regex", "(yes|no)"))
    ok = np.flatnonzero(c.allowed())
    vocab = alone.scheduler.embedding.vocab
    logits = np.linspace(0, 1, vocab).astype(np.float32)
    top8 = np.argsort(-logits)[:8]
    assert not set(top8) & set(ok)  # the best 8 are not allowed
    best_allowed = int(ok[np.argmax(logits[ok])])
    assert c.pick(_Greedy(), logits, top=int(top8[0])) == best_allowed
    logits[ok[0]] = 2.0
    assert c.pick(_Greedy(), logits, top=int(ok[0])) == ok[0]  # the graph's argmax, allowed: taken
    sampled = {c.pick(Sampler(SamplingConfig(temperature=1.0, seed=s)), logits) for s in range(20)}
    assert sampled <= set(ok.tolist())


@pytest.mark.parametrize("rf, param, says", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "format": "colour"}, "strict": True}},
     "response_format.json_schema.schema", "format"),
    ({"type": "json_schema", "json_schema": {"schema": "{not json"}}, "response_format.json_schema.schema", "JSON"),
    ({"type": "json_schema", "json_schema": {"schema": [1]}}, "response_format.json_schema.schema", "object"),
    ({"type": "json_schema", "json_schema": 3}, "response_format.json_schema", "object"),
    ({"type": "xml"}, "response_format.type", "json_schema"),
])
def test_bad_response_formats_are_one_line_naming_the_field(alone, rf, param, says):
    with pytest.raises(GrammarError) as e:
        "".join(alone.generate("hi", max_new_tokens=4, response_format=rf))
    assert e.value.param == param and str(e.value).startswith(param + ": ") and says in str(e.value)
    assert "\n" not in str(e.value)


def test_cli_run_refuses_a_bad_schema_file_in_one_line(tiny, tmp_path):
    bad = tmp_path / "schema.json"
    for text in ('{"type": ', '{"type": "string", "format": "colour"}'):
        bad.write_text(text)
        p = subprocess.run([sys.executable, "-m", "vlmrt.cli", "run", str(tiny.bundle), "--prompt", "hi",
                            "--json-schema", str(bad)], capture_output=True, text=True, timeout=120)
        assert p.returncode == 1 and p.stdout == ""
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"vlmrt: error: --json-schema {bad}: "), p.stderr
    p = subprocess.run([sys.executable, "-m", "vlmrt.cli", "run", str(tiny.bundle), "--prompt", "hi",
                        "--json-schema", str(tmp_path / "missing.json")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "cannot read it" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_batch_holds_records_to_their_own_schema_or_the_jobs(tiny, tmp_path, capsys):
    """vlmrt batch --regex: a record with its own response_format answers it (its line's "json" the value, the text
    VLM.chat's), one without takes the job's, a record whose response_format is not one is its error line."""
    from vlmrt import cli

    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}}
    src = tmp_path / "records.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in [
        {"id": "own", "prompt": "Describe it.", "response_format": rf},
        {"id": "job", "prompt": "Colours?"},
        {"id": "bad", "prompt": "Describe it.", "response_format": {"type": "json_schema", "json_schema": 1}},
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    assert cli.main(["batch", str(tiny.bundle), "--input", str(src), "--output", str(out), "--max-new-tokens", "60",
                     "--regex", "(red|green|blue)( (red|green|blue)){2,5}", "--quiet"]) == 0
    capsys.readouterr()
    by = {d["id"]: d for d in map(json.loads, out.read_text().splitlines())}
    vlm = VLM.load(tiny.bundle)
    want = "".join(vlm.chat([{"role": "user", "content": "Describe it."}], max_new_tokens=60, response_format=rf))
    assert by["own"]["text"] == want and by["own"]["json"] == json.loads(want)
    assert re.fullmatch(r"(red|green|blue)( (red|green|blue)){2,5}", by["job"]["text"]) and "json" not in by["job"]
    assert by["bad"]["error"].startswith("response_format.json_schema: ")
    spec = GrammarSpec("regex", "(red|green|blue)( (red|green|blue)){2,5}", param="--regex")
    assert pickle.loads(pickle.dumps(spec)) == spec  # (how a job's options reach Ray Data actors)
