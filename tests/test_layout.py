"""The repository's layout, checked from the source (parsed with ast, nothing imported):

- the package (peagle/) imports nothing from the lab (lab/: the demo target's trainer, measurement scripts, studies);
- the package's import graph has no cycles, module by module (function-level imports included) and part by part
  (a part: a subpackage or a top-level module), so every part sits on a layer above the parts it imports;
- no two code folders share a name;
- the engine holds no drafter row state (the proposer owns its rows, what it still has to catch up, and its cost)."""
import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "peagle"
SKIP_DIRS = {".venv", ".venv-vllm", "build", "runs", "data", "models", "docs", "__pycache__", ".git", "bench-out"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py")) if "__pycache__" not in p.parts}


def imported(name: str, path: Path) -> set[str]:
    """Every module `name` imports (absolute names; relative imports resolved), at any depth of the file."""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                mod = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = {f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in MODULES}
            out.update(subs)
            if len(subs) < len(node.names):       # names from the module itself (`from .. import sub` is the sub)
                out.add(mod)
    return out


GRAPH = {m: {d for d in imported(m, p) if d in MODULES and d != m} for m, p in MODULES.items()}


def cycle(graph: dict) -> list | None:
    """One cycle of the directed graph, or None."""
    state, stack = {}, []

    def visit(v):
        state[v] = "open"
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == "open":
                return stack[stack.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = "done"
        stack.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_package_imports_nothing_from_the_lab():
    bad = sorted(f"{m} imports {d}" for m, p in MODULES.items() for d in imported(m, p)
                 if d == "lab" or d.startswith("lab."))
    assert not bad, bad


def test_import_graph_has_no_cycles():
    assert len(MODULES) > 50
    assert cycle(GRAPH) is None, " -> ".join(cycle(GRAPH))


def part(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_parts_are_layered():
    """Nothing points back up: the graph of parts (peagle.engine, peagle.autok, ...) has no cycles either. The
    package's __init__ (the public facade) is left out: it sits above everything it re-exports."""
    parts: dict = {}
    for m, deps in GRAPH.items():
        if m == "peagle":
            continue
        for d in deps:
            if d != "peagle" and part(d) != part(m):
                parts.setdefault(part(m), set()).add(part(d))
    assert cycle(parts) is None, " -> ".join(cycle(parts))


def test_no_two_code_folders_share_a_name():
    seen: dict = {}
    for d, subdirs, files in os.walk(ROOT):
        subdirs[:] = [s for s in subdirs if s not in SKIP_DIRS and not s.startswith(".")]
        if Path(d) != ROOT and any(f.endswith((".py", ".sh")) for f in files):
            seen.setdefault(Path(d).name, set()).add(str(Path(d).relative_to(ROOT)))
    shared = {name: sorted(dirs) for name, dirs in seen.items() if len(dirs) > 1}
    assert not shared, shared


# the drafter's per-row state: its rows still to feed, their auxiliary hidden states, their counts, the rows a
# catch-up adds; the engine should ask the proposer to draft and tell it what was accepted, nothing more
DRAFTER_ROW_STATE = {"draft_ids", "draft_aux", "draft_n", "draft_rows", "_defer_drafter_context"}


def drafter_state_in_engine() -> list:
    tree = ast.parse((PKG / "engine.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in DRAFTER_ROW_STATE:
            found.add(node.attr)
        elif isinstance(node, ast.Name) and node.id in DRAFTER_ROW_STATE:
            found.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in DRAFTER_ROW_STATE:
            found.add(node.name)
    return sorted(found)


def test_engine_holds_no_drafter_row_state():
    held = drafter_state_in_engine()
    assert not held, f"peagle/engine.py still holds the drafter's row state: {held}"
