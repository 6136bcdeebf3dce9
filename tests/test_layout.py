"""The layout rule of src/vlmrt (docs/architecture.md): no import cycle between its modules — every import
statement counted, also those inside functions. Modules are split by concept, not by a line count (issue 29)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def modules() -> dict[str, Path]:
    out = {}
    for p in (SRC / "vlmrt").rglob("*.py"):
        name = ".".join(p.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The modules of the package that `name` imports (a package's own ancestors left out: importing a submodule
    runs them, they are not a dependency it chose)."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):
                found.add(t)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    mods = modules()
    graph = {m: imports(m, p, mods) for m, p in mods.items()}
    assert graph["vlmrt.cli"], "the import walk found nothing: it is broken"
    assert cycles(graph) == []


def test_the_cycle_check_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]



def packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between the packages (and top-level modules) of src/vlmrt: vlmrt.export -> vlmrt.eval where
    any module of the one imports any of the other."""
    def top(m: str) -> str:
        return ".".join(m.split(".")[:2])

    out: dict[str, set[str]] = {}
    for m, targets in graph.items():
        out.setdefault(top(m), set()).update(top(t) for t in targets if top(t) != top(m))
    for targets in list(out.values()):
        for t in targets:
            out.setdefault(t, set())
    return out


def test_no_import_cycle_between_packages():
    """A package does not import one that imports it back (eval/reference.py once read checkpoints through
    export/checkpoint.py while the export took its calibration prompts from eval/samples.py)."""
    mods = modules()
    graph = packages({m: imports(m, p, mods) for m, p in mods.items()})
    assert "vlmrt.families" in graph["vlmrt.export"], "the package walk found nothing: it is broken"
    assert cycles(graph) == []
