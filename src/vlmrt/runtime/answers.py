"""The one loop that runs answers: VLMs over one scheduler (a server's slots, a batch job's sequences, or one VLM
alone: VLM.generate / chat), a round at a time.

    loop = AnswerLoop(VLM.slots(bundle, 4))        # or AnswerLoop([vlm])
    loop.begin(vlm.prepare(...))                   # VLM i's answer (VLM.prepare raises on bad input)
    for slot, kind, value in loop.round():         # ("piece", text) ... then ("done", Result) | ("error", exception)
        ...
    loop.cancel(slot)                              # a client gone: its sequence leaves the row

A round: each answer still encoding its images runs one vision call (one tile), and one whose images are done is
admitted to the scheduler (its first prompt block runs in this round); then one scheduler step (runtime/decode/scheduler.py:
a prompt block for each prompt, one decoder call for all that decode); then each advanced answer's new ids become
text pieces (VLM.stream); an answer that ended (or met a stop string) gives its last pieces and its Result. An answer
that fails (a bad image, a call that raised) fails alone: its ("error", exception), the others go on.
"""

from __future__ import annotations

from .decode.scheduler import Scheduler


class AnswerLoop:
    def __init__(self, vlms: list):
        """vlms: VLMs over one scheduler, VLM i on row i (VLM.slots), or one VLM."""
        self.vlms = vlms
        self.scheduler: Scheduler = vlms[0].scheduler
        self.answers: dict[int, object] = {}  # slot -> its Answer
        self._encoding: dict[int, object] = {}  # slot -> VLM.encode(answer), while its images are encoded

    @property
    def busy(self) -> bool:
        return bool(self.answers)

    def free(self, slot: int) -> bool:
        return slot not in self.answers

    def begin(self, a) -> None:
        """Run the prepared answer a (VLM.prepare) of the VLM it was prepared by, from the next round."""
        slot = a.slot
        self.answers[slot] = a
        self._encoding[slot] = self.vlms[slot].encode(a)

    def cancel(self, slot: int) -> None:
        """The answer on slot stops where it is (its sequence leaves the row; the prefix cache records what it holds)."""
        a = self.answers.pop(slot, None)
        enc = self._encoding.pop(slot, None)
        if enc is not None:
            enc.close()
        if a is None:
            return
        if a.seq is not None:
            self.scheduler.remove(a.seq)
        self.vlms[slot].release(a, False)

    def round(self) -> list[tuple[int, str, object]]:
        """One round (see the module's doc): the events of each answer, in slot order."""
        events: list[tuple[int, str, object]] = []
        for slot, enc in list(self._encoding.items()):
            vlm = self.vlms[slot]
            try:
                next(enc)
                continue  # (more tiles to encode)
            except StopIteration:
                del self._encoding[slot]
                try:
                    vlm.admit(self.answers[slot])
                except Exception as e:
                    self._fail(slot, e, events)
            except Exception as e:
                del self._encoding[slot]
                self._fail(slot, e, events)
        advanced = self.scheduler.step() if self.scheduler.running else []
        for seq in advanced:
            slot = seq.row
            a = self.answers.get(slot)
            if a is None or a.seq is not seq:  # (a sequence that is not one of this loop's answers)
                continue
            vlm = self.vlms[slot]
            try:
                events += [(slot, "piece", p) for p in vlm.stream(a, seq.take())]  # (those before a failure too)
                if seq.error is not None:
                    self._fail(slot, seq.error, events)
                    continue
                if a.cut.stopped and not seq.done:
                    self.scheduler.remove(seq)
                if seq.done or a.cut.stopped:
                    events += [(slot, "piece", p) for p in vlm.finish(a)]
                    del self.answers[slot]
                    events.append((slot, "done", a.res))
            except Exception as e:
                self._fail(slot, e, events)
        return events

    def _fail(self, slot: int, e: BaseException, events: list) -> None:
        self.cancel(slot)
        events.append((slot, "error", e))
