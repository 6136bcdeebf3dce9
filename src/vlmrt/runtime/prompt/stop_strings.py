"""Stop strings: the streamed answer is cut before the first stop string, and generation ends there.

    cut = StopStrings(["\\n\\n", "User:"])
    for piece in pieces:
        out = cut.feed(piece)   # the text that is safe to show now (a possible start of a stop string is held back)
        if cut.stopped: break
    out += cut.flush()          # whatever was held back, once no more text comes
    cut.text                    # the answer, cut before the stop string
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str] | None):
        stops = list(stops or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        self.stops = stops
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        self.text += piece
        hits = [i for s in self.stops if (i := self.text.find(s, self.emitted)) >= 0]
        if hits:
            self.stopped = True
            self.text = self.text[: min(hits)]
            return self._emit(len(self.text))
        hold = 0  # the longest end of the text that begins a stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text) - self.emitted), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return self._emit(len(self.text) - hold)

    def flush(self) -> str:
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        out = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        return out
