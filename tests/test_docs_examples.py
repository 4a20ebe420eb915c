"""The code in the docs runs: every ```python block of docs/**/*.md and README.md, page by page.

Each page's blocks run in order, sharing one namespace, in a fresh Python process inside a
temporary directory (a page may start a process group or write ``runs/``; a fresh process
keeps that from the test run and from the next page). Errors point at the page and line.

Hand-written rather than sybil or pytest-markdown-docs: both run blocks inside the pytest
process, which the pages' process groups and relative paths would share. The markdown is
parsed with markdown-it-py, the parser myst-parser (the docs build) already uses.

Markers, HTML comments that neither Sphinx nor GitHub show:

* ``<!-- docs-test: setup`` (code) ``-->`` runs hidden code at that point: the names a fragment
  takes as given (a model, an optimizer); ``check`` is the same, for asserting what a block did;
* ``<!-- docs-test: is examples/NAME.py -->``: the next block is that file as written (checked
  here; the file itself runs in tests/test_examples.py);
* ``<!-- docs-test: skip REASON -->``: the next block does not run here (few, each with its reason).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).parent.parent
PAGES = [
    page
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    if "_build" not in page.parts and re.search(r"^```python$", page.read_text(), re.M)
]
MARKER = re.compile(r"<!--\s*docs-test:\s*(setup|check|skip|is)\b(.*?)-->", re.S)
STORE = re.compile(r"\b(s3|gs|az)://bucket\b")  # a page's object store: the emulator's bucket "bucket"
# runs each (page, line, code) in one namespace, compiled so that tracebacks name the page's own lines
RUNNER = """import json, sys
namespace = {"__name__": "__main__"}
for page, line, code in json.load(sys.stdin):
    exec(compile("\\n" * (line - 1) + code, page, "exec"), namespace)
"""


@dataclass
class Page:
    """A page's blocks to run (page, first line, code), the blocks that are files, and the skipped blocks."""

    blocks: list[tuple[str, int, str]] = field(default_factory=list)
    files: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def parse(path: Path) -> Page:
    """The page's python blocks and markers, in order (a marker applies to the next python block)."""
    name, page, pending = str(path.relative_to(ROOT)), Page(), None
    for token in MarkdownIt("commonmark").parse(path.read_text()):
        if token.type == "html_block" and (marker := MARKER.search(token.content)):
            kind, text = marker.group(1), marker.group(2)
            if kind in ("setup", "check"):
                page.blocks.append((name, token.map[0] + 2, text.strip("\n")))
            else:
                pending = (kind, text.strip())
        elif token.type == "fence" and token.info.strip() == "python":
            if pending and pending[0] == "skip":
                page.skipped.append(f"{name}:{token.map[0] + 1}: {pending[1]}")
                compile(token.content, f"{name}:{token.map[0] + 1}", "exec")  # a skipped block still parses
            elif pending and pending[0] == "is":
                page.files.append((pending[1], token.content))
            else:
                page.blocks.append((name, token.map[0] + 2, token.content))
            pending = None
    return page


@pytest.mark.parametrize("path", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_the_pages_python_blocks_run(path, tmp_path, request):
    page = parse(path)
    for example, code in page.files:
        assert code.rstrip() == (ROOT / example).read_text().rstrip(), f"{path.name}: the block is not {example}"
    if not page.blocks:
        pytest.skip("; ".join(page.skipped + [f"the block is {f} (tests/test_examples.py)" for f, _ in page.files]))
    for scheme in sorted(set(STORE.findall("".join(code for _, _, code in page.blocks)))):
        _make_bucket(request.getfixturevalue(f"{scheme}_server"))  # its endpoint is now in os.environ
    run = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps(page.blocks),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # pages run beside other tests
    )
    assert run.returncode == 0, f"a python block of {path.relative_to(ROOT)} failed:\n{run.stderr[-4000:]}"


def test_few_blocks_are_skipped_and_each_says_why():
    skipped = [s for p in PAGES for s in parse(p).skipped]
    assert all(re.search(r": \S.{10,}$", s) for s in skipped), skipped  # a reason, not just "skip"
    assert len(skipped) <= 8, skipped


def _make_bucket(server) -> None:
    """The bucket ``bucket`` on the emulator (session-wide: created once per server)."""
    if not getattr(server, "docs_bucket", False):
        server.make_bucket("bucket")
        server.docs_bucket = True


# the API reference's docstring examples that are whole (the others are fragments of a training loop)
DOCTESTED = ["shardpoint.parallel.topology", "shardpoint.state.sharding"]


@pytest.mark.parametrize("module", DOCTESTED)
def test_the_reference_examples_run(module):
    import doctest
    import importlib

    import shardpoint as sp

    names = {"sp": sp, **{n: getattr(sp, n) for n in sp.__all__ if n != "__version__"}}
    result = doctest.testmod(importlib.import_module(module), extraglobs=names, optionflags=doctest.ELLIPSIS)
    assert result.attempted and not result.failed
