"""Sphinx configuration for shardpoint's documentation (built by ../scripts/docs, warnings as errors)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

import shardpoint

project = "shardpoint"
author = "shardpoint developers"
copyright = "2026, shardpoint developers"
release = shardpoint.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
    "cli_reference",
    "bench_plots",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "_generated"]
html_theme = "furo"
html_title = f"shardpoint {release}"
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# the integrations import their framework only when used; these may be absent where the docs are built
autodoc_mock_imports = ["deepspeed", "megatron"]
nitpicky = False
