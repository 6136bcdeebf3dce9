"""A token's own bytes and text, as OpenAI's logprobs give them (`token`, `bytes`): what the token adds to the answer's
UTF-8 text, a piece of a character included (its `token` then spells the bytes as `\\xNN`, as OpenAI does).

    tb = TokenBytes(tokenizer)          # a tokenizers.Tokenizer
    tb.bytes(id), tb.text(id)           # b' Paris', ' Paris'; b'\\xe4\\xb8', '\\\\xe4\\\\xb8'

Read from the tokenizer's vocabulary through its decoder's steps (tokenizer.json `decoder`), never by decoding the
token alone (a lone token's decode loses a leading space to a Strip step and a piece of a character to U+FFFD):
ByteLevel (GPT-2's byte-to-character table: SmolLM2, Qwen, LFM2), ByteFallback (`<0xNN>` tokens) and Replace
(SentencePiece's "▁" as a space); added tokens are their content."""

from __future__ import annotations

import json
import re

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the character standing for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def _steps(decoder: dict | None) -> list[dict]:
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [s for d in decoder.get("decoders", []) for s in _steps(d)]
    return [decoder]


class TokenBytes:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        decoder = tokenizer.decoder
        steps = _steps(json.loads(decoder.__getstate__()) if decoder is not None else None)
        kinds = {s.get("type") for s in steps}
        self.byte_level = _byte_level_table() if "ByteLevel" in kinds else None
        self.byte_fallback = "ByteFallback" in kinds
        self.replace = [(s["pattern"]["String"], s.get("content", "")) for s in steps
                        if s.get("type") == "Replace" and "String" in s.get("pattern", {})]
        self.added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._memo: dict[int, bytes] = {}

    def bytes(self, token: int) -> bytes:
        out = self._memo.get(token)
        if out is None:
            out = self._memo[token] = self._bytes(token)
        return out

    def _bytes(self, token: int) -> bytes:
        if token in self.added:
            return self.added[token].encode()
        piece = self.tok.id_to_token(token)
        if piece is None:
            return b""
        if self.byte_fallback:
            m = _BYTE_TOKEN.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
        table = self.byte_level
        if table is not None and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        for old, new in self.replace:
            piece = piece.replace(old, new)
        return piece.encode()

    def text(self, token: int) -> str:
        """The token's bytes as text; bytes that are not whole UTF-8 characters as \\xNN escapes."""
        return self.bytes(token).decode("utf-8", errors="backslashreplace")
