"""Bad input: one readable error line, a non-zero exit, no traceback, nothing half-written."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import CASES, exported, image_file
from vlmrt import cli
from vlmrt.cli.options import stats_report


def run_cli(*args, env=None):
    """The real command line in a fresh interpreter; also proves `vlmrt run` never imports torch."""
    code = (
        "import sys; from vlmrt import cli; rc = cli.main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules or sys.argv[1] != 'run', 'vlmrt run imported torch'; sys.exit(rc)"
    )
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def assert_one_line_error(p, *needles):
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.strip().splitlines() if not re.match(r"\[\d+/\d+\] ", ln)]  # export progress
    assert len(lines) == 1 and lines[0].startswith("vlmrt: error: "), p.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def in_process(capsys, *args):
    capsys.readouterr()  # drop what fixtures printed
    rc = cli.main([str(a) for a in args])
    err = capsys.readouterr().err
    return subprocess.CompletedProcess(args, rc, "", err)


def test_run_in_fresh_process_works_without_torch(default_bundle):
    p = run_cli("run", default_bundle.bundle, "--image", image_file("chelsea.png", None), "--prompt", "Hi",
                "--max-new-tokens", 3, "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(out) >= {"text", "token_ids", "prompt_tokens", "stats"}
    assert set(out["stats"]) >= {"load_s", "preprocess_s", "vision_s", "ttft_s", "prefill_tokens_per_s",
                                 "decode_tokens_per_s", "peak_rss_mb"}


def test_human_output_has_stats_report(default_bundle):
    p = run_cli("run", default_bundle.bundle, "--prompt", "Hi", "--max-new-tokens", 3)
    assert p.returncode == 0, p.stderr
    for k in ("prompt tokens", "generated tokens", "model load", "image preprocess", "vision encode",
              "time to 1st token", "prefill", "decode", "peak RSS"):
        assert k in p.stderr


def test_one_token_answer_reports_no_decode_rate():
    """A one-token answer came from prefill alone: the report says so instead of "0.0 tokens/s"."""
    from vlmrt import chat_repl, cli
    from vlmrt.runtime.vlm import Result, RunStats

    one = Result(stats=RunStats(prompt_tokens=9, generated_tokens=1, stop_reason="eos"))
    assert "none (the one token came from prefill)" in stats_report(one)
    assert "tok/s" not in chat_repl.summary(one.stats)
    two = Result(stats=RunStats(prompt_tokens=9, generated_tokens=2, decode_tokens_per_s=50.0,
                                decode_ms_per_token=20.0, stop_reason="eos"))
    assert "50.0 tokens/s (20.0 ms/token)" in stats_report(two)
    assert "2 tokens, 50.0 tok/s" in chat_repl.summary(two.stats)


def test_first_use_build_is_reported_apart():
    """The default model's first-use build (its own process) is a line of its own after the answer's figures, never
    their peak RSS (issue 43); without a build the report has no such line."""
    from vlmrt.demo.default_model import BuildReport
    from vlmrt.runtime.vlm import Result, RunStats

    r = Result(stats=RunStats(prompt_tokens=21, generated_tokens=1, stop_reason="eos", peak_rss_mb=716.2))
    lines = stats_report(r, BuildReport(124.31, 4285.4)).splitlines()
    assert lines[-2:] == ["peak RSS           716 MB",
                          "first-use build    124.3 s, peak RSS 4285 MB (the default model, built in a process of its own)"]
    assert BuildReport(124.31, 4285.44).to_dict() == {"seconds": 124.31, "peak_rss_mb": 4285.4}
    assert "first-use" not in stats_report(r)


def test_bench_json_reports_every_timing(default_bundle):
    """vlmrt bench: min/median/max over the runs (each a fresh load), exactly --gen-tokens tokens, a prompt of
    --prompt-tokens tokens (image included) as closely as whole words allow, peak RSS."""
    p = run_cli("bench", default_bundle.bundle, "--image", image_file("chelsea.png", None), "--prompt-tokens", 180,
                "--gen-tokens", 5, "--runs", 2, "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["runs"] == 2 and r["generated_tokens"] == 5 and r["peak_rss_mb"] > 0
    assert r["image_tiles"] == 7  # the cat photo on this fixture: 2x3 tiles + the global one
    # the filler's words are at most 3 tokens each: the prompt stops short of 180 by less than one word
    assert 177 <= r["prompt_tokens"] <= 180, r["prompt_tokens"]
    for k in ("load_s", "preprocess_s", "vision_s", "ttft_s", "decode_tokens_per_s", "host_overhead_ms_per_step"):
        assert 0 < r[k]["min"] <= r[k]["median"] <= r[k]["max"], k
    # per run ttft covers preprocess + vision + prefill, so each order statistic does too
    for s in ("min", "median", "max"):
        assert r["ttft_s"][s] > r["vision_s"][s] and r["ttft_s"][s] > r["preprocess_s"][s]


def test_missing_image(default_bundle, capsys, tmp_path):
    p = in_process(capsys, "run", default_bundle.bundle, "--image", tmp_path / "nope.png", "--prompt", "hi")
    assert_one_line_error(p, "image not found")


@pytest.mark.parametrize("content", [b"", b"not an image at all", b"\x89PNG\r\n\x1a\n" + b"\0" * 40])
def test_corrupt_image(default_bundle, capsys, tmp_path, content):
    bad = tmp_path / "bad.png"
    bad.write_bytes(content)
    assert_one_line_error(in_process(capsys, "run", default_bundle.bundle, "--image", bad, "--prompt", "hi"), "cannot read image")


def test_truncated_image(default_bundle, capsys, tmp_path):
    bad = tmp_path / "cut.jpg"
    bad.write_bytes(image_file("rocket.jpg", None).read_bytes()[:3000])
    assert_one_line_error(in_process(capsys, "run", default_bundle.bundle, "--image", bad, "--prompt", "hi"), "cannot read image")


@pytest.fixture
def bundle_copy(default_bundle, tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(default_bundle.bundle, dst)
    return dst


@pytest.mark.parametrize("victim", ["decoder.data", "decoder.onnx", "tokenizer.json", "embed.npy"])
def test_altered_bundle_file(bundle_copy, capsys, victim):
    with open(bundle_copy / victim, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    p = in_process(capsys, "run", bundle_copy, "--prompt", "hi")
    assert_one_line_error(p, "sha256 mismatch", victim)


def test_missing_bundle_file(bundle_copy, capsys):
    os.remove(bundle_copy / "vision.data")
    assert_one_line_error(in_process(capsys, "run", bundle_copy, "--prompt", "hi"), "missing", "vision.data")


def test_bundle_of_an_older_schema_is_refused(bundle_copy, capsys):
    """A bundle of schema 2 (decoder flags, no positions input, kv as one layout) is refused in one line that names
    the re-export; nothing of it is read as the new contract."""
    m = json.loads((bundle_copy / "manifest.json").read_text())
    m["schema_version"] = 2
    (bundle_copy / "manifest.json").write_text(json.dumps(m))
    assert_one_line_error(in_process(capsys, "run", bundle_copy, "--prompt", "hi"),
                          "bundle schema version 2 is not supported (this vlmrt reads 3)", "vlmrt export")


def test_verify_ar_without_a_verify_graph_is_refused(bundle_copy, capsys):
    """decoder.kind.verify_ar and graphs.verify (the HTP target's lookahead verify graph) come together, kind
    rows_static."""
    m = json.loads((bundle_copy / "manifest.json").read_text())
    m["decoder"]["kind"] = {"name": "rows_static", "mask_input": "attention_mask", "verify_ar": 5}
    (bundle_copy / "manifest.json").write_text(json.dumps(m))
    assert_one_line_error(in_process(capsys, "run", bundle_copy, "--prompt", "hi"),
                          "graphs.verify and decoder.kind.verify_ar (>= 2, kind rows_static) go together")


def test_lookahead_that_the_bundle_cannot_verify_is_refused(bundle_copy, capsys):
    """A draft length over the graph's AR, a negative one, and a decoder with int8 activations are one-line errors
    (static graphs without a verify graph: test_lookahead.py)."""
    ar = json.loads((bundle_copy / "manifest.json").read_text())["decoder"]["prefill_ar"]
    for n, needle in ((ar, f"--lookahead is at most {ar - 1}"), (-1, "--lookahead must be >= 0")):
        assert_one_line_error(in_process(capsys, "run", bundle_copy, "--prompt", "hi", "--lookahead", n), needle)
    m = json.loads((bundle_copy / "manifest.json").read_text())
    m["graphs"]["decode"]["weights"]["lm_head"] = "w8a8"  # int8 activations: a verify step is not a decode step
    (bundle_copy / "manifest.json").write_text(json.dumps(m))
    assert_one_line_error(in_process(capsys, "run", bundle_copy, "--prompt", "hi", "--lookahead", "2"),
                          "needs a decoder with float activations", "w8a8")


def test_not_a_bundle(capsys, tmp_path):
    assert_one_line_error(in_process(capsys, "run", tmp_path, "--prompt", "hi"), "not a vlmrt bundle")
    (tmp_path / "manifest.json").write_text("{ nope")
    assert_one_line_error(in_process(capsys, "run", tmp_path, "--prompt", "hi"), "cannot read")
    (tmp_path / "manifest.json").write_text(json.dumps({"schema_version": 999}))
    assert_one_line_error(in_process(capsys, "run", tmp_path, "--prompt", "hi"), "schema version 999")


def test_prompt_longer_than_context(tmp_path_factory, capsys):
    small = exported(CASES[1], tmp_path_factory)  # max context 96
    p = in_process(capsys, "run", small.bundle, "--prompt", "red green blue " * 60)
    assert_one_line_error(p, "prompt is", "max context is 96", "--max-seq-len")
    p = in_process(capsys, "run", small.bundle, "--image", image_file("chelsea.png", None), "--prompt", "red " * 80)
    assert_one_line_error(p, "image + prompt is", "--max-seq-len")


def test_bad_sampling_args(default_bundle, capsys):
    assert_one_line_error(in_process(capsys, "run", default_bundle.bundle, "--prompt", "hi", "--top-p", "0"), "top-p")
    assert_one_line_error(in_process(capsys, "run", default_bundle.bundle, "--prompt", "hi", "--max-new-tokens", "0"), "max-new-tokens")


@pytest.mark.parametrize("flag, value, needle", [
    ("--temperature", "nan", "temperature must be a finite number >= 0, not nan"),  # was numpy's "Probabilities contain NaN"
    ("--temperature", "inf", "temperature must be a finite number >= 0, not inf"),  # was a uniform draw
    ("--seed", "-3", "seed must be >= 0, not -3"),  # was numpy's "expected non-negative integer"
])
def test_sampling_args_numpy_cannot_take(default_bundle, capsys, flag, value, needle):
    p = in_process(capsys, "run", default_bundle.bundle, "--prompt", "hi", "--temperature", "1", flag, value)
    assert_one_line_error(p, needle)


@pytest.mark.parametrize("threads", ["0", "-1", "100000"])
def test_threads_out_of_range(default_bundle, capsys, threads):
    """0 and -1 were passed to ORT as they are (0: its default); 100,000 hung the load starting threads."""
    for cmd in ("run", "bench", "serve"):
        args = [cmd, default_bundle.bundle, "--threads", threads] + (["--prompt", "hi"] if cmd == "run" else [])
        assert_one_line_error(in_process(capsys, *args), "--threads must be between 1 and", f"not {threads}")


def test_negative_top_k(default_bundle, capsys):
    assert_one_line_error(in_process(capsys, "run", default_bundle.bundle, "--prompt", "hi", "--top-k", "-1"), "top-k must be >= 0")


def test_device_cuda_without_cuda(default_bundle, capsys):
    import onnxruntime as ort

    # the test extra's onnxruntime is the CPU build: it has no CUDA provider
    assert "CUDAExecutionProvider" not in ort.get_available_providers()
    p = in_process(capsys, "run", default_bundle.bundle, "--prompt", "hi", "--device", "cuda")
    assert_one_line_error(p, "device 'cuda' needs onnxruntime's CUDAExecutionProvider")


def test_max_tiles_on_a_bundle_without_a_tile_count(default_bundle, capsys):
    """SmolVLM's tiling has no tile-count setting (InternVL's --max-tiles 0: tests/test_internvl.py)."""
    p = in_process(capsys, "run", default_bundle.bundle, "--image", image_file("chelsea.png", None), "--prompt", "hi",
                   "--max-tiles", "0")
    assert_one_line_error(p, "--max-tiles does not apply")


def test_eval_bad_arguments(default_bundle, capsys, tmp_path):
    b = default_bundle.bundle
    assert_one_line_error(in_process(capsys, "eval", b), "vlmrt eval needs BUNDLE and --reference")
    assert_one_line_error(in_process(capsys, "eval", "--reference", b), "vlmrt eval needs BUNDLE and --reference")
    assert_one_line_error(in_process(capsys, "eval", b, "--reference", b, "--tokens", "0"), "--tokens must be >= 1")
    assert_one_line_error(in_process(capsys, "eval", b, "--dataset", "mnist"), "unknown --dataset 'mnist'")
    assert_one_line_error(in_process(capsys, "eval", b, "--reference", tmp_path / "nope"),
                          f"reference {tmp_path / 'nope'} is neither a bundle nor a checkpoint folder")


@pytest.mark.parametrize("text, needle", [
    ("[" * 100_000 + "]" * 100_000, "is not JSON: nested too deeply"),
    ('[{"role": "user", "content": "hi", "n": 1' + "0" * 5000 + "}]", "is not JSON: Exceeds the limit"),
    ('[{"role": "user", "content": "\\ud800 hi"}]', "message 1: the text is not valid Unicode"),
])
def test_messages_file_that_python_cannot_take(default_bundle, capsys, tmp_path, text, needle):
    """JSON that the parser cannot nest or convert, and text that cannot be tokenized, are one line each."""
    (tmp_path / "conv.json").write_text(text)
    assert_one_line_error(in_process(capsys, "run", default_bundle.bundle, "--messages", tmp_path / "conv.json"), needle)


def test_bench_prompt_shorter_than_the_image(default_bundle, capsys):
    """The cat photo's 7 tiles and the chat template are 146 tokens on this fixture: 120 cannot be met."""
    p = in_process(capsys, "bench", default_bundle.bundle, "--image", image_file("chelsea.png", None), "--prompt-tokens", 120)
    assert_one_line_error(p, "--prompt-tokens 120 is less than the image + chat template alone (146 tokens)")


@pytest.mark.parametrize("counts", [("100000", "2"), ("300", "21")])
def test_bench_over_the_context(default_bundle, capsys, counts):
    """--prompt-tokens 100000 spent minutes building the prompt word by word; 300 + 21 on a 320-token context stopped
    each run at the context, short of --gen-tokens."""
    p = in_process(capsys, "bench", default_bundle.bundle, "--prompt-tokens", counts[0], "--gen-tokens", counts[1])
    assert_one_line_error(p, f"--prompt-tokens {counts[0]} + --gen-tokens {counts[1]} is more than the bundle's max "
                             "context (320 tokens)")


@pytest.mark.parametrize("flag", ["--runs", "--gen-tokens", "--prompt-tokens"])
def test_bench_counts_below_one(default_bundle, capsys, flag):
    assert_one_line_error(in_process(capsys, "bench", default_bundle.bundle, flag, "0"), "must be >= 1")


def test_image_token_in_user_text_is_refused(default_bundle, capsys):
    p = in_process(capsys, "run", default_bundle.bundle, "--prompt", "look: <image>")
    assert_one_line_error(p, "image tokens")


# --- export -----------------------------------------------------------------------------------

def _no_leftovers(parent):
    assert not [p for p in parent.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("missing, command, extra", [
    ("starlette", "serve", "serve"), ("uvicorn", "serve", "serve"), ("prometheus_client", "serve", "serve"),
    ("torch", "export", "export"), ("onnx", "export", "export"), ("onnxscript", "export", "export"),
])
def test_a_command_whose_extra_is_not_installed_says_which(tmp_path, missing, command, extra):
    """`vlmrt serve` on an install without the serve extra (the quick start's `vlmrt[export]`), `vlmrt export` on
    the runtime alone: one line naming the extra, no traceback (both were tracebacks from an import)."""
    code = (f"import sys; sys.modules[{missing!r}] = None; from vlmrt import cli; "
            "sys.exit(cli.main(sys.argv[1:]))")
    args = [command, tmp_path / "src", tmp_path / "out"] if command == "export" else [command, tmp_path, "--port", "0"]
    p = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert_one_line_error(p, f"vlmrt {command} needs the {extra} extra", f"pip install 'vlmrt[{extra}]'")
    assert not (tmp_path / "out").exists()


def test_export_unknown_model_type(default_bundle, tmp_path, capsys):
    ck = tmp_path / "ck"
    shutil.copytree(default_bundle.ckpt, ck)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["model_type"] = "mystery_vlm"
    (ck / "config.json").write_text(json.dumps(cfg))
    p = in_process(capsys, "export", ck, tmp_path / "out", "--quiet")
    assert_one_line_error(p, "unknown model type 'mystery_vlm'")
    assert not (tmp_path / "out").exists()


def test_export_missing_weight_leaves_nothing(default_bundle, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    ck = tmp_path / "ck"
    shutil.copytree(default_bundle.ckpt, ck)
    t = load_file(ck / "model.safetensors")
    del t["model.text_model.norm.weight"]
    save_file(t, ck / "model.safetensors")
    p = in_process(capsys, "export", ck, tmp_path / "out", "--quiet")
    assert_one_line_error(p, "missing weight model.text_model.norm.weight")
    assert not (tmp_path / "out").exists()
    _no_leftovers(tmp_path)


def test_export_refuses_existing_output(default_bundle, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    assert_one_line_error(in_process(capsys, "export", default_bundle.ckpt, tmp_path / "out"), "already exists", "--force")


def test_export_missing_source_and_offline_hub(tmp_path):
    assert_one_line_error(run_cli("export", tmp_path / "nothing_here", tmp_path / "out"), "checkpoint not found")
    p = run_cli("export", "HuggingFaceTB/SmolVLM-256M-Instruct", tmp_path / "out", env={"HF_HUB_OFFLINE": "1"})
    assert_one_line_error(p, "cannot download HuggingFaceTB/SmolVLM-256M-Instruct")
    assert not (tmp_path / "out").exists()


def test_export_bad_calibration_folder(default_bundle, tmp_path, capsys):
    p = in_process(capsys, "export", default_bundle.ckpt, tmp_path / "out", "--target", "htp", "--calibration", tmp_path / "nope")
    assert_one_line_error(p, "calibration folder not found")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "prompts.txt").write_text("Describe it.\n")
    p = in_process(capsys, "export", default_bundle.ckpt, tmp_path / "out", "--target", "htp", "--calibration", tmp_path / "empty")
    assert_one_line_error(p, "no images in calibration folder")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, needle", [
    (["--context-step", "1"], "--context-step must be 0"),
    (["--context-step", "64", "--target", "htp"], "--target htp"),
    (["--context-step", "4096"], "larger than the max context"),
    (["--quant", "w4a9m"], "unknown precision 'w4a9m'"),
])
def test_export_bad_context_step_or_precision(default_bundle, tmp_path, capsys, args, needle):
    assert_one_line_error(in_process(capsys, "export", default_bundle.ckpt, tmp_path / "out", *args), needle)
    assert not (tmp_path / "out").exists()
