"""The benchmarks: each a module run from the repository root, `python -m benchmarks.NAME ...` (benchmarks/README.md:
what each measures and which figure in docs/ it backs).

vlmrt itself comes from the installed package (`scripts/setup` installs it editable; PYTHONPATH=src for another tree).
The benchmarks that build random checkpoints use the test suite's builders (tests/fixtures*.py, tests/fuzz_targets.py):
those are plain modules that import each other by name, as pytest's rootdir import puts tests/ on sys.path, so tests/
joins sys.path here, once, for every benchmark.
"""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parents[1] / "tests")
if _TESTS not in sys.path:
    sys.path.append(_TESTS)
