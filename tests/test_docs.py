"""The documentation cannot drift from the code: every public name has a reference entry, and the
getting-started FSDP2 example is the file that tests/test_examples.py runs. (``./scripts/docs``
builds the site with warnings as errors; the CLI reference is generated from the parser.)"""

from __future__ import annotations

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
