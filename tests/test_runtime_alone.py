"""The runtime installs and runs alone: `pip install vlmrt` (no extras) into a fresh venv, then `vlmrt run BUNDLE`
answers, and neither `onnx` nor `torch` is ever imported (nor even tried: a meta-path hook records every attempt).

Takes about 60 s here (venv + pip install of the repo and numpy/onnxruntime/tokenizers/Pillow from pip's cache and
the configured indexes; measured 58 s on a loaded 2-core machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BLOCKER = '''
import os, sys
class _Refuse:
    """Records and refuses every import of the export-only packages."""
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("onnx", "torch", "onnxscript", "safetensors", "transformers"):
            with open(os.environ["VLMRT_IMPORT_LOG"], "a") as f:
                f.write(name + "\\n")
            raise ImportError(f"{name} is blocked: the runtime must not import it")
        return None
sys.meta_path.insert(0, _Refuse())
'''


def test_runtime_alone_in_a_fresh_venv(default_bundle, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    pip = subprocess.run([str(py), "-m", "pip", "install", "-q", str(REPO)], capture_output=True, text=True, timeout=900)
    assert pip.returncode == 0, pip.stderr[-3000:]
    # the runtime's dependencies only: none of the export extra came along
    probe = subprocess.run([str(py), "-c", "import importlib.util as u; print([m for m in ('onnx', 'torch', 'onnxscript', "
                            "'safetensors') if u.find_spec(m)])"], capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "[]", probe.stdout

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(BLOCKER)
    log = tmp_path / "imports.log"
    log.write_text("")
    env = {**os.environ, "PYTHONPATH": str(hook), "VLMRT_IMPORT_LOG": str(log), "VLMRT_CACHE": str(tmp_path / "cache")}
    env.pop("VIRTUAL_ENV", None)
    image = REPO / "tests" / "corpus" / "images" / "exif_orientation_6.jpg"
    p = subprocess.run([str(venv / "bin" / "vlmrt"), "run", str(default_bundle.bundle), "--prompt", "hi", "--image", str(image),
                        "--max-new-tokens", "3", "--json"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["stats"]["generated_tokens"] >= 1 and out["prompt_tokens"] > 0
    # the hook was live in that process (it logs what it refuses), and it refused nothing
    check = subprocess.run([str(py), "-c", "import onnx"], capture_output=True, text=True, env=env)
    assert "blocked" in check.stderr
    assert log.read_text() == "onnx\n", log.read_text()
