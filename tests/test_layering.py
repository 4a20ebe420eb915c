"""The package's layers, read from its imports: no circles, nothing imported upward, no private names.

The layer order is written here and only here (each subpackage's docstring says what
it may import, in words). A module imports only from its own layer or the ones
before it in :data:`LAYERS`. Imports inside functions count: a function-level
import that closes a circle only hides it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# lowest first; a module belongs to the layer of the longest prefix that names it
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("shardpoint.errors", "shardpoint._version")),
    ("parallel", ("shardpoint.parallel",)),
    ("storage", ("shardpoint.storage",)),
    ("catalog", ("shardpoint.catalog",)),
    ("state", ("shardpoint.state",)),
    ("formats", ("shardpoint.formats",)),
    ("lifecycle", ("shardpoint.lifecycle",)),
    ("tier", ("shardpoint.tier",)),
    ("checkpointer", ("shardpoint.checkpointer",)),
    ("api", ("shardpoint",)),
    ("offline", ("shardpoint.offline",)),
    ("foreign", ("shardpoint.foreign",)),
    ("integrations", ("shardpoint.integrations",)),
    ("tools", ("shardpoint.commands", "shardpoint.demo", "shardpoint.bench", "shardpoint.cli")),
)


def modules(src: Path, package: str = "shardpoint") -> dict[str, Path]:
    """``{dotted name: file}`` of every module of ``package`` under ``src`` (packages by their ``__init__``)."""
    found = {}
    for path in sorted((src / package).rglob("*.py")):
        name = ".".join(path.relative_to(src).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, str]]:
    """``(imported module, imported name or "")`` for every import of a known module, anywhere in the file."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_package else name.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub, "") if sub in known else (base, alias.name))
    result = []
    for target, attr in found:
        while target not in known and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in known and target != name:
            result.append((target, attr))
    return result


def graph(known: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> modules it imports; a package's ``__init__`` importing its own submodules is no edge."""
    edges = {}
    for name, path in known.items():
        is_package = path.name == "__init__.py"
        edges[name] = {
            target for target, _ in imports(name, path, known) if not (is_package and target.startswith(name + "."))
        }
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def layer_of(name: str) -> int:
    best, rank = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            # a prefix names its submodules too, except the root package, which names only itself
            below = name.startswith(prefix + ".") and prefix != "shardpoint"
            if (name == prefix or below) and len(prefix) > best:
                best, rank = len(prefix), i
    return rank


def upward(edges: dict[str, set[str]]) -> list[str]:
    return [
        f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
        for a in sorted(edges)
        for b in sorted(edges[a])
        if layer_of(b) > layer_of(a)
    ]


def private_imports(known: dict[str, Path]) -> list[str]:
    """Imports of another module's ``_name``, or of a ``_module`` from outside the package that holds it."""
    bad = []
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for target, attr in imports(name, path, known):
            if attr.startswith("_") and not attr.startswith("__"):
                bad.append(f"{name} imports {target}.{attr}")
            private = next((p for p in target.split(".") if p.startswith("_") and not p.startswith("__")), None)
            if private:
                owner = target[: target.index("." + private)]
                if not (package == owner or package.startswith(owner + ".")):
                    bad.append(f"{name} imports {target}, private to {owner}")
    return bad


KNOWN = modules(SRC)
EDGES = graph(KNOWN)


def test_every_module_has_a_layer():
    assert [name for name in KNOWN if layer_of(name) < 0] == []


def test_no_import_circles():
    assert circles(EDGES) == []


def test_no_import_runs_up_a_layer():
    assert upward(EDGES) == []


def test_no_private_names_across_modules():
    assert private_imports(KNOWN) == []


def test_few_modules_at_the_root():
    """Root modules are the base, the Checkpointer and the entry points; layers live in subpackages."""
    root = sorted(p.stem for p in (SRC / "shardpoint").glob("*.py") if p.stem != "__init__")
    assert root == ["_version", "bench", "checkpointer", "cli", "errors"]


@pytest.mark.parametrize(
    "files, problem",
    [
        ({"a.py": "from shardpoint.pkg import b\n", "b.py": "def f():\n    from shardpoint.pkg import a\n"}, "circle"),
        ({"a.py": "from shardpoint.checkpointer import X\n"}, "upward"),
        ({"a.py": "from shardpoint.pkg.b import _helper\n", "b.py": ""}, "private"),
    ],
)
def test_checks_catch_a_planted_problem(tmp_path, files, problem):
    """The checks fail on a circle hidden in a function, an upward import and a private name."""
    pkg = tmp_path / "shardpoint" / "pkg"
    pkg.mkdir(parents=True)
    (tmp_path / "shardpoint" / "__init__.py").write_text("")
    (tmp_path / "shardpoint" / "checkpointer.py").write_text("X = 1\n")
    (pkg / "__init__.py").write_text("")
    for name, text in files.items():
        (pkg / name).write_text(text)
    known = modules(tmp_path)
    edges = graph(known)
    # shardpoint.pkg sits in no layer: treat it as the lowest for this check
    global LAYERS
    saved = LAYERS
    LAYERS = (("pkg", ("shardpoint.pkg",)), *saved)
    try:
        found = {"circle": circles(edges), "upward": upward(edges), "private": private_imports(known)}
    finally:
        LAYERS = saved
    assert found[problem], f"the {problem} check missed {files}"
    assert all(not v for k, v in found.items() if k != problem)
