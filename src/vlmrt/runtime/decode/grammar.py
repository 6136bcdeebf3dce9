"""Grammar-constrained decoding: an answer held to a JSON schema, a Lark grammar or a regex, token by token, through
llguidance (the engine ORT GenAI, vLLM, llama.cpp and SGLang use; a native wheel with no dependencies).

    grammars = Grammars(tokenizer, vocab=49280, eos_ids=[2])      # one per bundle (its tokenizer), built lazily
    spec = GrammarSpec("json_schema", '{"type": "object"}')        # or from_response_format(OpenAI's response_format)
    c = grammars.constraint(spec)     # GrammarError (one line, its .param the field) for a bad or unsupported grammar
    token = c.pick(sampler, logits_row, top)   # the sampler's choice among the tokens the grammar allows
    c.accept(token); c.finished                # the matcher advanced; finished: the grammar allows nothing more
    c.valid_prefix(drafts); c.rollback(n)      # lookahead drafts checked, and undone

Compiling a grammar (the matcher's lexer and parser tables) is cached by its text (bounded): a sequence gets a copy
of the compiled matcher. JSON schemas compile compact (no whitespace between tokens: `{"a":1,"b":[2,3]}`), so that a
small model cannot spend its budget on spaces; a schema's own "x-guidance" options override that.

The mask is applied to the same logits the sampler sees, one per sequence (Scheduler: constrained and free sequences
share a round). Greedy: the row's argmax (the graph's argmax output where it has one, or np.argmax) is taken when the
grammar allows it, which is then the argmax over the allowed tokens; else the argmax of the masked row. So with the
re-scored 4-bit head (`lm_head=w4a8r`: the graph re-scores only the 4-bit head's top 8 from 8-bit rows) the choice is
still over every allowed token: the re-scored logit where the allowed token is among the 8, its 4-bit logit where
not. Sampling: the sampler draws from the masked row (disallowed logits -inf: probability 0, before top-k / top-p).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

MAX_COMPILED = 64  # compiled grammars kept (least recently used dropped)
# JSON schemas compile compact unless the schema's "x-guidance" says otherwise
JSON_DEFAULTS = {"whitespace_flexible": False}
KINDS = ("json_schema", "lark", "regex")


class GrammarError(ValueError):
    """A grammar that cannot be used: invalid, or asking for what the engine does not support. param: the request
    field it came from (the server's 400 names it)."""

    def __init__(self, message: str, param: str = "response_format"):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    """What an answer is held to: kind json_schema (text: the schema as JSON), lark (a Lark grammar, llguidance's
    dialect: %json {schema} inside it too) or regex. lenient: unsupported JSON-schema keywords are ignored (OpenAI's
    strict: false) rather than refused. param: the request field it came from (errors name it)."""

    kind: str
    text: str
    lenient: bool = False
    param: str = field(default="response_format", compare=False)  # (not the grammar: the cache's key leaves it out)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r} (one of {', '.join(KINDS)})", self.param)

    @classmethod
    def json_schema(cls, schema, strict: bool = True, param: str = "response_format") -> "GrammarSpec":
        """A JSON schema (a dict, or its JSON text) as a spec; GrammarError if it is not a JSON object."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}", param) from None
        if not isinstance(schema, dict):
            raise GrammarError("the JSON schema must be a JSON object", param)
        return cls("json_schema", json.dumps(schema), not strict, param)  # (its property order is the answer's)

    @classmethod
    def from_response_format(cls, rf, param: str = "response_format", flat: bool = False) -> "GrammarSpec | None":
        """OpenAI's response_format: {"type": "text"} (None: free text), {"type": "json_object"} (any JSON object),
        {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}; flat: the Responses API's text.format,
        {"type": "json_schema", "name", "schema", "strict"}. GrammarError naming the field."""
        if rf is None:
            return None
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_schema({"type": "object"}, param=param)
        if kind == "json_schema":
            js, at = (rf, param) if flat else (rf.get("json_schema"), f"{param}.json_schema")
            if not isinstance(js, dict):
                raise GrammarError("json_schema must be an object {\"name\", \"schema\", \"strict\"}", at)
            if not isinstance(js.get("strict", False), (bool, type(None))):
                raise GrammarError("strict must be a boolean", f"{at}.strict")
            schema = js.get("schema", {"type": "object"})
            return cls.json_schema(schema, bool(js.get("strict")), f"{at}.schema")
        raise GrammarError("type must be \"text\", \"json_object\" or \"json_schema\"", f"{param}.type")

    def grammar(self) -> str:
        """The llguidance grammar (its JSON) of this spec."""
        import llguidance

        if self.kind == "json_schema":
            defaults = dict(JSON_DEFAULTS, lenient=self.lenient)
            return llguidance.LLMatcher.grammar_from_json_schema(self.text, defaults=defaults)
        return llguidance.grammar_from(self.kind, self.text)


class Grammars:
    """A bundle's grammar compiler: its tokenizer as llguidance's (built on the first grammar: ~0.3 s at 49k tokens,
    ~0.9-1.8 s and 87 MB at 151k) and the compiled grammars (cached by spec, at most MAX_COMPILED)."""

    def __init__(self, tokenizer, vocab: int, eos_ids: list[int]):
        """tokenizer: the bundle's tokenizers.Tokenizer; vocab: the logits' width (tokens past the tokenizer's are
        never allowed); eos_ids: the tokens that end an answer (allowed where the grammar may end)."""
        self.tokenizer, self.vocab, self.eos_ids = tokenizer, vocab, list(eos_ids)
        self._ll = None
        self._compiled: OrderedDict[GrammarSpec, object] = OrderedDict()
        self._unclaimed: dict[GrammarSpec, float] = {}  # compile seconds no constraint has reported yet
        self._lock = threading.Lock()
        self._building = threading.Lock()  # (one tokenizer build, whichever thread asks first)

    def _tokenizer(self):
        with self._building:
            if self._ll is None:
                import llguidance

                self._ll = llguidance.LLTokenizer(self.tokenizer.to_str(), n_vocab=self.vocab, eos_token=self.eos_ids)
        return self._ll

    def literal(self, text: str) -> str:
        """text as a Lark term: the tokenizer's one special token for it where it has one (llguidance lets an added
        token match only as itself, <[id]>, never as the same text in pieces), else the quoted string."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) == 1 and self._tokenizer().is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    def compile(self, spec: GrammarSpec):
        """The compiled matcher of spec (cached; GrammarError if the grammar is invalid or unsupported)."""
        return self._compile(spec)[0]

    def _compile(self, spec: GrammarSpec) -> tuple[object, float]:
        """(the compiled matcher of spec, the seconds its compile took: 0.0 from the cache)."""
        with self._lock:
            m = self._compiled.get(spec)
            if m is not None:
                self._compiled.move_to_end(spec)
                return m, 0.0
        import llguidance

        tok = self._tokenizer()
        t = time.perf_counter()
        try:
            grammar = spec.grammar()
        except (ValueError, TypeError) as e:
            raise GrammarError(_first_line(str(e)), spec.param) from None
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(_first_line(m.get_error()), spec.param)
        dt = time.perf_counter() - t
        with self._lock:
            self._compiled[spec] = m
            self._unclaimed[spec] = dt
            while len(self._compiled) > MAX_COMPILED:
                self._unclaimed.pop(self._compiled.popitem(last=False)[0], None)
        return m, dt

    def constraint(self, spec: GrammarSpec) -> "Constraint":
        """A fresh per-sequence constraint for spec; its compile_s: the seconds spec's compile took if this is the
        first constraint made of it since (a compile ahead of it, as the server's, included), else 0.0."""
        m, _ = self._compile(spec)
        c = Constraint(m.deep_copy(), self.vocab)
        with self._lock:
            c.compile_s = self._unclaimed.pop(spec, 0.0)
        return c


def _first_line(msg: str) -> str:
    lines = [s.strip() for s in msg.strip().splitlines() if s.strip()]
    return lines[0][:300] if lines else "invalid grammar"


class Constraint:
    """One sequence's grammar state: its matcher (the tokens accepted so far) and the mask of the next token."""

    def __init__(self, matcher, vocab: int):
        self.matcher, self.vocab = matcher, vocab
        self.bits = np.full((1, (vocab + 31) // 32), -1, np.int32)  # llguidance's bitmask, 1 = allowed
        self._fresh = False  # bits hold the mask of the matcher's present state
        self.compile_s = 0.0  # its grammar's compile (Grammars.constraint; 0.0: from the cache)

    def compute_mask(self) -> None:
        """The next token's mask into bits (a no-op if it is already there): ~4-5 µs at 151k-262k tokens, computed
        right before the pick (a thread to overlap it with the decoder call costs more: docs/performance.md)."""
        if self._fresh:
            return
        v = self.bits[0]
        self.matcher.unsafe_compute_mask_ptr(v.ctypes.data, v.nbytes)
        self._fresh = True

    def allows(self, token: int) -> bool:
        self.compute_mask()
        return 0 <= token < self.vocab and bool((int(self.bits[0, token >> 5]) >> (token & 31)) & 1)

    def allowed(self) -> np.ndarray:
        """[vocab] bool: the tokens the grammar allows next."""
        self.compute_mask()
        return np.unpackbits(self.bits.view(np.uint8), count=self.vocab, bitorder="little").view(bool)

    def pick(self, sampler, logits: np.ndarray, top: int | None = None) -> int:
        """sampler's choice from logits [vocab] among the allowed tokens. top: the row's argmax where the graph
        computed it (greedy: taken if allowed; module doc)."""
        if sampler.cfg.temperature == 0:
            top = int(np.argmax(logits)) if top is None else int(top)
            if self.allows(top):
                return top
        ok = self.allowed()
        if not ok.any():
            raise GrammarError("the grammar allows no token here")
        return sampler(np.where(ok[: logits.shape[-1]], logits, -np.inf))

    def accept(self, token: int) -> bool:
        """The matcher takes token (False: the grammar does not allow it; the matcher is then in error)."""
        self._fresh = False
        return self.matcher.consume_token(int(token))

    @property
    def finished(self) -> bool:
        """The grammar allows nothing more (its end reached and nothing may follow): the answer is complete."""
        return self.matcher.is_stopped()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of tokens, from the first, the grammar allows in a row (lookahead drafts)."""
        return self.matcher.validate_tokens([int(t) for t in tokens]) if tokens else 0

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens (a lookahead verify's drafts)."""
        if n:
            self._fresh = False
            if not self.matcher.rollback(n):
                raise GrammarError(f"the grammar could not roll back {n} tokens")
