"""llama.cpp side of benchmarks/compare.py: is llama-cpp-python there, the GGUF conversion of a SmolVLM checkpoint
with the convert_hf_to_gguf.py that the llama-cpp-python sdist vendors (nothing of llama.cpp is committed here),
libmtmd's timings read from its log; and one llama-bench test in its own process with its cache type and peak RSS
(llama_bench, for benchmarks/long_prompts.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"


def have_llama_cpp() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def needs_no_repack(gguf: Path) -> bool:
    """Whether llama.cpp must load models with `--no-repack` here: a tiny eval in a child process that dies from a
    signal (SIGILL / SIGSEGV: the VM reports AMX but faults on its tile instructions) and passes without the extra
    buffer types. Sets VLMRT_LLAMA_NO_REPACK for the runners (runners/llama_no_repack.py) when so."""
    code = ("import sys; import llama_no_repack; from llama_cpp import Llama; "
            "m = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=2, verbose=False); m.eval(m.tokenize(b'Hello there'))")
    runners = str(Path(__file__).resolve().parent / "runners")

    def ok(no_repack: str) -> bool:
        env = {**os.environ, "VLMRT_LLAMA_NO_REPACK": no_repack}
        # run in runners/ (python -c puts the working directory first on sys.path: llama_no_repack is found there)
        return subprocess.run([sys.executable, "-c", code, str(Path(gguf).resolve())], env=env, cwd=runners,
                              capture_output=True).returncode == 0

    if ok("0"):
        return False
    if not ok("1"):
        raise RuntimeError("llama.cpp fails on this machine with and without --no-repack")
    os.environ["VLMRT_LLAMA_NO_REPACK"] = "1"
    return True


def find_gguf() -> Path:
    from vlmrt.demo.smollm2 import find_gguf as f

    return f()


def sdist(work: Path) -> Path:
    """The unpacked llama-cpp-python sdist's llama.cpp tree: $LLAMA_CPP_SRC, or the sdist from PyPI (pip download)."""
    if os.environ.get("LLAMA_CPP_SRC"):
        return Path(os.environ["LLAMA_CPP_SRC"])
    root = work / "llama-cpp-python-sdist"
    tree = next(root.glob("llama_cpp_python-*/vendor/llama.cpp"), None) if root.exists() else None
    if tree is None:
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", LLAMA_CPP_PYTHON,
                        "-d", str(root)], check=True, capture_output=True)
        with tarfile.open(next(root.glob("llama_cpp_python-*.tar.gz"))) as t:
            t.extractall(root, filter="data")
        tree = next(root.glob("llama_cpp_python-*/vendor/llama.cpp"))
    return tree


def convert(ckpt: Path, out: Path, log: Path, outtype: str = "f16") -> tuple[Path, Path]:
    """ckpt (a SmolVLM / Idefics3 HF folder) -> (text GGUF, mmproj GGUF). The converter maps the text model by
    text_config.architectures (["VLlama3ForCausalLM"], as the released SmolVLM configs have); a checkpoint
    without it is converted from a copy of its folder with that one field added. It imports sentencepiece."""
    text, mmproj = out / f"text-{outtype}.gguf", out / f"mmproj-{outtype}.gguf"
    if text.exists() and mmproj.exists():
        return text, mmproj
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((ckpt / "config.json").read_text())
    src = ckpt
    if cfg.get("text_config", {}).get("architectures") != ["VLlama3ForCausalLM"]:
        src = out / "ckpt"
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir()
        for f in ckpt.iterdir():
            if f.name != "config.json":
                os.symlink(f.resolve(), src / f.name)
        cfg.setdefault("text_config", {})["architectures"] = ["VLlama3ForCausalLM"]
        (src / "config.json").write_text(json.dumps(cfg, indent=1))
    tree = sdist(out.parent)
    env = {**os.environ, "PYTHONPATH": str(tree / "gguf-py")}  # the converter's own gguf-py, not PyPI's gguf
    with open(log, "w") as lf:
        for extra, dst in (([], text), (["--mmproj"], mmproj)):
            p = subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(src), "--outtype", outtype,
                                "--outfile", str(dst), *extra], stdout=lf, stderr=subprocess.STDOUT, env=env)
            if p.returncode != 0:
                raise RuntimeError(f"convert_hf_to_gguf.py {' '.join(extra)} failed ({p.returncode}); see {log}")
    if not mmproj.exists():  # some versions name the projector file themselves
        found = sorted(out.glob("mmproj*.gguf"))
        if not found:
            raise RuntimeError(f"no mmproj GGUF written; see {log}")
        mmproj = found[0]
    return text, mmproj


def mtmd_timings(stderr: str) -> dict:
    """libmtmd's log (verbose): 'image slice encoded in N ms' per slice (the vision encoder) and
    'image decoded (batch i/n) in N ms' (the image tokens through the text model)."""
    enc = [int(x) for x in re.findall(r"image slice encoded in (\d+) ms", stderr)]
    dec = [int(x) for x in re.findall(r"image decoded \(batch \d+/\d+\) in (\d+) ms", stderr)]
    n_prompt = re.findall(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens", stderr)
    return {"vision_s": sum(enc) / 1000, "image_prefill_s": sum(dec) / 1000, "tiles": len(enc),
            "prompt_tokens": int(n_prompt[0]) if n_prompt else None}


# llama-bench's cache options: its default f16 cache (flash attention "auto"), q8_0 K and V (a quantized V cache needs
# flash attention on)
LLAMA_CACHES = {"f16": [], "q8_0": ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]}


def llama_bench(binary: Path, gguf: Path, threads: int, cache: str, prompt: int = 0, gen: int = 0,
                depth: int = 0) -> dict:
    """One llama-bench test in its own process (no warmup, one repetition): `prompt` tokens (-p) or `gen` tokens
    generated (-n) after a context of `depth` tokens (-d, not timed), cache type `cache` (LLAMA_CACHES). Its
    tokens/s and the process's peak RSS (MB, from wait4)."""
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(gen), "-d", str(depth),
           "-r", "1", "--no-warmup", "-o", "json", *LLAMA_CACHES[cache]]
    if os.environ.get("VLMRT_LLAMA_NO_REPACK") == "1":
        cmd += ["--repack", "0"]
    with tempfile.TemporaryFile("w+") as errf:  # (a file, not a pipe: nothing blocks while stdout is read)
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errf, text=True)
        out = p.stdout.read()
        _, status, usage = os.wait4(p.pid, 0)  # (wait4: this child's own rusage)
        p.returncode = rc = os.waitstatus_to_exitcode(status)
        if rc != 0:
            errf.seek(0)
            raise RuntimeError(f"llama-bench exited {rc}: {errf.read().strip()[-400:]}")
    (test,) = json.loads(out)
    return {"tokens_per_s": test["avg_ts"], "peak_rss_mb": usage.ru_maxrss / 1024, "n_prompt": test["n_prompt"],
            "n_gen": test["n_gen"], "n_depth": test.get("n_depth", 0), "flash_attn": test.get("flash_attn"),
            "type_k": test.get("type_k"), "type_v": test.get("type_v")}
