"""A bundle's sessions with a hook before every decoder graph call: tests that interrupt, hold or fail the n-th call
(tests/test_paths_meet.py, tests/test_serve_paths.py) subclass DecoderCallHook and define tick()."""
from collections.abc import Mapping


class DecoderCallHook(Mapping):
    """Wraps a bundle's sessions mapping; every call of a decoder graph (run or run_with_iobinding, any graph but
    "vision") calls self.tick() first."""

    def __init__(self, sessions):
        self.inner = sessions

    def tick(self) -> None:
        raise NotImplementedError

    def __getitem__(self, name):
        s = self.inner[name]
        return s if name == "vision" else _Hooked(s, self.tick)

    def __iter__(self):
        return iter(self.inner)

    def __len__(self):
        return len(self.inner)


class _Hooked:
    def __init__(self, session, tick):
        self._s, self._tick = session, tick

    def run(self, *a, **k):
        self._tick()
        return self._s.run(*a, **k)

    def run_with_iobinding(self, *a, **k):
        self._tick()
        return self._s.run_with_iobinding(*a, **k)

    def __getattr__(self, name):
        return getattr(self._s, name)
