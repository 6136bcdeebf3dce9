"""No code outside a kind's own class asks which kind it has (issue 44 item 2): the runtime (runtime/, serve/, batch/)
and the manifest's cross-field checks (format/checks.py) never compare a decoder kind's or a cache layer kind's name,
never test a cache layer's class, and never read a decoder kind's optional parts with getattr (they are explicit:
manifest.KindParts, each kind's parts()). A kind's behaviour lives in its class: runtime/decode/decoder_kinds.py,
runtime/decode/state_kinds.py, the kind's dataclass in format/manifest.py. On main 6bf0bd2 this finds 15 name or class
branches (format/checks.py, runtime/bundle.py, decoder_kinds.py's conv branches, kv_cache.py's isinstance) and 11
getattr reads (decoder_kinds.py, checks.py, batch_engine.py, pipeline.py). The scan also covers eval/, web/'s Python,
export/ and cli/: on main 864ccf6 it finds there eval/reference.py's attention-name test and three getattr reads,
eval/accuracy.py's and web/site.py's getattr of hidden_output, web/site.py's two name tests and export/pipeline.py's two
tests of the attention kind's name (graphs.LAYOUTS[...].in_place says it). A list of what another implementation runs
(web/site.py BROWSER_DECODER_KINDS: static/decoder.js's kinds) is a registry, not a branch."""

import ast
import dataclasses
from pathlib import Path

from vlmrt.format.manifest import CACHE_LAYER_KINDS, DECODER_KINDS, KindParts

SRC = Path(__file__).resolve().parents[1] / "src" / "vlmrt"
SCANNED = [*(p for d in ("runtime", "serve", "batch", "eval", "export", "cli") for p in sorted((SRC / d).rglob("*.py"))),
           *sorted((SRC / "web").glob("*.py")), SRC / "format" / "checks.py"]
NAMES = set(DECODER_KINDS) | set(CACHE_LAYER_KINDS)
LAYER_CLASSES = {cls.__name__ for cls in CACHE_LAYER_KINDS.values()}
OPTIONAL = {f.name for f in dataclasses.fields(KindParts)} - {"step_inputs"}


def findings(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value in NAMES or isinstance(c, (ast.Tuple, ast.List, ast.Set)) and any(
                    isinstance(e, ast.Constant) and e.value in NAMES for e in c.elts)
                for c in [node.left, *node.comparators]):
            out.append(f"line {node.lineno}: compares a kind's name: {ast.unparse(node)[:80]}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "isinstance" and any(isinstance(a, ast.Name) and a.id in LAYER_CLASSES
                                                    for a in ast.walk(node.args[1])):
                out.append(f"line {node.lineno}: tests a cache layer's class: {ast.unparse(node)[:80]}")
            if node.func.id in ("getattr", "hasattr") and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                    and node.args[1].value in OPTIONAL:
                out.append(f"line {node.lineno}: reads an optional part by name: {ast.unparse(node)[:80]}")
    return out


def test_no_kind_branches_outside_the_kinds():
    found = {str(p.relative_to(SRC)): f for p in SCANNED if (f := findings(ast.parse(p.read_text())))}
    assert not found, found


def test_the_scan_finds_each_kind_of_branch():
    """findings() itself: each form it looks for, planted once."""
    planted = """
if layer.kind == "conv": pass
if k.name in ("rows_dynamic", "rows_static"): pass
x = [l for l in layers if isinstance(l, ConvLayer)]
v = getattr(spec, "hidden_output", None)
"""
    assert len(findings(ast.parse(planted))) == 4
    assert not findings(ast.parse('name = "conv"\nx = parts.hidden_output\nif kind.layout.in_place: pass'))
