"""The documentation cannot drift from the code: every public name has a reference entry, and the
getting-started FSDP2 example is the file that tests/test_examples.py runs. (``./scripts/docs``
builds the site with warnings as errors; the CLI reference is generated from the parser.)"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import shardpoint

DOCS = Path(__file__).parent.parent / "docs"


def test_every_public_name_has_a_reference_entry():
    reference = (DOCS / "reference" / "api.rst").read_text() + (DOCS / "reference" / "errors.rst").read_text()
    missing = [n for n in shardpoint.__all__ if n != "__version__" and f":: shardpoint.{n}\n" not in reference]
    assert missing == [], f"add these to docs/reference/api.rst or errors.rst: {missing}"


def test_getting_started_shows_the_tested_fsdp2_example_first():
    example = (DOCS.parent / "examples" / "fsdp2_tp.py").read_text()
    page = (DOCS / "getting-started.md").read_text()
    assert example.rstrip() in page
    assert "fully_shard" in "\n".join(page.splitlines()[:25])  # FSDP2 in the page's first lines


def test_every_environment_variable_is_documented():
    used: set[str] = set()
    for path in (DOCS.parent / "src" / "shardpoint").rglob("*.py"):
        used |= set(re.findall(r"SHARDPOINT_[A-Z0-9_]+[A-Z0-9]", path.read_text()))
    page = (DOCS / "reference" / "environment.md").read_text()
    assert sorted(v for v in used if f"`{v}`" not in page) == []


INTEGRATIONS = ["transformers", "accelerate", "lightning", "torchtitan", "torchft", "megatron", "deepspeed"]


def test_every_public_name_of_every_integration_has_a_reference_entry():
    """Each name of each integration's ``__all__`` is in the API reference (read from the sources: no framework
    is imported). autodoc's ``:members:`` skips a name without a docstring, so such a name needs its own entry."""
    entries = _reference_entries((DOCS / "reference" / "api.rst").read_text())
    missing = []
    for integration in INTEGRATIONS:
        module = f"shardpoint.integrations.{integration}"
        source = DOCS.parent / "src" / "shardpoint" / "integrations" / integration
        source = source / "__init__.py" if source.is_dir() else source.with_suffix(".py")
        for name in _all(source):
            explicit = any(t.startswith(module) and name in (t.rsplit(".", 1)[-1], *m) for t, m in entries)
            whole = (module, ("*",)) in entries and _documented(source, name)
            if not (explicit or whole):
                missing.append(f"{module}.{name}")
    assert missing == [], f"add these to docs/reference/api.rst (or give them a docstring): {missing}"


def _reference_entries(rst: str) -> list[tuple[str, tuple[str, ...]]]:
    """Each ``.. autoX:: target`` with its ``:members:`` list (``("*",)`` for all documented members)."""
    entries = []
    for match in re.finditer(r"^\.\. auto\w+:: ([\w.]+)\n((?:   .*\n)*)", rst, re.M):
        members = re.search(r":members:(.*)", match.group(2))
        listed = tuple(n.strip() for n in members.group(1).split(",") if n.strip()) if members else ()
        entries.append((match.group(1), listed or (("*",) if members else ())))
    return entries


@functools.cache
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _all(path: Path) -> list[str]:
    for node in _parse(path).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


def _documented(path: Path, name: str, depth: int = 0) -> bool:
    """Whether autodoc finds a docstring (or a ``#:`` comment) for ``name``, defined in ``path`` or imported there
    from another shardpoint module (autodoc documents both when ``__all__`` names them)."""
    lines = path.read_text().splitlines()
    for node in _parse(path).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
            return ast.get_docstring(node) is not None
        if isinstance(node, ast.Assign) and name in [getattr(t, "id", "") for t in node.targets]:
            return lines[node.lineno - 2].lstrip().startswith("#:")
        if isinstance(node, ast.ImportFrom) and name in [a.asname or a.name for a in node.names] and depth < 4:
            if not (node.level or (node.module or "").startswith("shardpoint.")):
                return False
            origin = (path.parent if node.level else DOCS.parent / "src").joinpath(*(node.module or "").split("."))
            origin = origin / "__init__.py" if origin.is_dir() else origin.with_suffix(".py")
            return origin.exists() and _documented(origin, name, depth + 1)
    return False


def test_every_committed_bench_run_is_plotted_on_the_benchmarks_page():
    """docs/bench/*.json are ``shardpoint bench --json`` reports, each drawn by a ``{bench-plot}`` on the page."""
    import json

    page = (DOCS / "benchmarks.md").read_text()
    runs = sorted((DOCS / "bench").glob("*.json"))
    assert runs, "commit a `shardpoint bench --json` report as docs/bench/NAME.json"
    for run in runs:
        assert f"```{{bench-plot}} bench/{run.name}" in page, f"docs/benchmarks.md does not plot {run.name}"
        for report in json.loads(run.read_text()):
            assert {"dir", "size_bytes", "ranks", "repeat", "rows", "ratios"} <= set(report), run.name
