"""tests/torchvision_ops.py (issue 43): torchvision::nms / qnms are declared only where torchvision's C++ library cannot
load with the installed torch. Where it loads (PyPI's default CUDA torch) it registers the torchvision namespace
itself, and a namespace declared before it aborted the process at collection (Fatal Python error).

Both cases on a stand-in torchvision package (a folder first on sys.path) whose _C is a real C++ library built here
against the installed torch: one that loads and registers the two schemas with TORCH_LIBRARY(torchvision, ...) as
torchvision's own does, and the same library linked against a library that is then removed (it cannot load: the
CPU torch's case, where torchvision's _C needs libtorch_cuda.so). The package's __init__ does what torchvision's does
with them: load _C if it can, then register fake kernels for the two ops."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
LIBRARY = """
#include <torch/library.h>
TORCH_LIBRARY(torchvision, m) {
  m.def("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor");
  m.def("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor");
}
"""
INIT = """
import importlib.machinery, os, torch
for suffix in importlib.machinery.EXTENSION_SUFFIXES:
    if os.path.isfile(os.path.join(os.path.dirname(__file__), "_C" + suffix)):
        try:
            torch.ops.load_library(os.path.join(os.path.dirname(__file__), "_C" + suffix))
        except OSError:
            pass
        break
for op in ("nms", "qnms"):  # torchvision/_meta_registrations.py
    torch.library.register_fake("torchvision::" + op)(lambda dets, scores, iou_threshold: dets.new_empty(0, dtype=torch.long))
"""
PROBE = """
import sys, torch
sys.path[:0] = [{package!r}, {tests!r}]
import torchvision_ops
declared = torchvision_ops.declare()
import torchvision
assert torchvision.__file__.startswith({package!r}), torchvision.__file__
print(declared, torch.ops.torchvision.nms.default._schema)
"""


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """(a stand-in torchvision whose _C loads, one whose _C cannot load)"""
    torch = pytest.importorskip("torch")
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("needs g++ (scripts/setup test installs it)")
    root = tmp_path_factory.mktemp("torchvision-ops")
    tdir = Path(torch.__file__).parent
    (root / "tv.cpp").write_text(LIBRARY)
    flags = ["-std=c++20", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
             f"-I{tdir / 'include'}", f"-I{tdir / 'include/torch/csrc/api/include'}"]
    subprocess.run([cxx, *flags, "-c", str(root / "tv.cpp"), "-o", str(root / "tv.o")], check=True,
                   capture_output=True)
    (root / "gone.c").write_text("int vlmrt_gone(void) { return 1; }\n")
    subprocess.run([cxx, "-shared", "-fPIC", "-x", "c", str(root / "gone.c"), "-o", str(root / "libgone.so")],
                   check=True, capture_output=True)
    name = "_C" + sysconfig.get_config_var("EXT_SUFFIX")
    made = []
    for kind, extra in (("loads", []), ("cannot-load", [f"-L{root}", "-Wl,--no-as-needed", "-lgone"])):
        pkg = root / kind / "torchvision"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(INIT)
        subprocess.run([cxx, "-shared", str(root / "tv.o"), "-o", str(pkg / name), f"-L{tdir / 'lib'}", "-lc10",
                        "-ltorch_cpu", f"-Wl,-rpath,{tdir / 'lib'}", *extra], check=True, capture_output=True)
        made.append(pkg.parent)
    (root / "libgone.so").unlink()  # as libtorch_cuda.so is missing beside the CPU torch
    return made


def _probe(package: Path) -> tuple[int, str]:
    p = subprocess.run([sys.executable, "-c", PROBE.format(package=str(package), tests=str(TESTS))],
                       capture_output=True, text=True, timeout=120)
    return p.returncode, (p.stdout + p.stderr).strip()


def test_schemas_declared_only_where_torchvisions_library_cannot_load(packages):
    loads, cannot = packages
    schema = "torchvision::nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
    # the library loads: it defines the namespace, nothing is declared before it (declared first: SIGABRT)
    assert _probe(loads) == (0, f"False {schema}")
    # it cannot load: the schemas are declared, and importing the package registers its fake kernels on them
    rc, out = _probe(cannot)
    assert (rc, out) == (0, f"True {schema}"), out


def test_the_real_torchvision_imports_after_declare():
    """The installed torchvision (CPU or CUDA torch): declare() then importing it and the transforms transformers' video
    processor uses works in a fresh process (test_video.py runs the processor), with the schemas declared exactly when
    its library does not load."""
    pytest.importorskip("torchvision")
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(TESTS)!r})
        import torchvision_ops
        import torch
        path = torchvision_ops.extension_path()
        declared = torchvision_ops.declare()
        import torchvision
        import torchvision.transforms.v2.functional
        print(declared, torchvision.extension._has_ops(), path is not None)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    declared, has_ops, found = p.stdout.split()
    assert found == "True" and declared == str(has_ops == "False"), p.stdout
