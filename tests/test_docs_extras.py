"""An integration whose framework is missing says which extra installs it, as the docs promise.

Each case imports one integration in a fresh interpreter in which a meta-path finder makes its
framework (and every submodule of it) unimportable, as if it were not installed: shardpoint
itself is not mocked. The extra named must exist in pyproject.toml and install that framework.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).parent.parent
# (integration module, the framework it needs, the extra that installs it)
CASES = [
    ("transformers", "transformers", "transformers"),
    ("accelerate", "accelerate", "accelerate"),
    ("lightning", "lightning", "lightning"),
    ("lightning_load", "lightning", "lightning"),
    ("torchtitan", "torchtitan", "torchtitan"),
    ("torchft", "torchft", "torchft"),
]
PROBE = """import importlib, importlib.abc, json, sys

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == FRAMEWORK or name.startswith(FRAMEWORK + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

FRAMEWORK = sys.argv[1]
sys.meta_path.insert(0, NotInstalled())
try:
    importlib.import_module("shardpoint.integrations." + sys.argv[2])
except Exception as exc:
    print(json.dumps({"types": [c.__name__ for c in type(exc).__mro__], "message": str(exc), "name": exc.name}))
"""


@pytest.mark.parametrize(("integration", "framework", "extra"), CASES, ids=[c[0] for c in CASES])
def test_an_integration_without_its_framework_names_its_extra(integration, framework, extra):
    run = subprocess.run([sys.executable, "-c", PROBE, framework, integration], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout, f"importing it raised nothing:\n{run.stderr[-2000:]}"
    error = json.loads(run.stdout)
    assert {"CheckpointError", "ModuleNotFoundError"} <= set(error["types"]), error
    assert f"pip install 'shardpoint[{extra}]'" in error["message"] and error["name"] == framework, error
    requirements = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][extra]
    assert any(re.match(rf"{framework}\b", r) for r in requirements), f"[{extra}] does not install {framework}"
