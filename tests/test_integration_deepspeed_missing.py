"""Without DeepSpeed installed, every entry point of shardpoint.integrations.deepspeed names the extra to install.

DeepSpeed's absence is simulated in a fresh interpreter by a finder at the front of
``sys.meta_path`` that refuses ``deepspeed`` and its submodules, as an environment
without the package would; shardpoint itself runs unchanged.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import importlib, json, sys

    class NoDeepSpeed:
        def find_spec(self, name, path=None, target=None):
            if name == "deepspeed" or name.startswith("deepspeed."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoDeepSpeed())
    import shardpoint.integrations.deepspeed as ds  # the package itself imports nothing of DeepSpeed
    from shardpoint.errors import CheckpointError

    found = {}

    def attempt(what, step):
        try:
            step()
            found[what] = "no error"
        except CheckpointError as exc:
            found[what] = f"{type(exc).__name__}: {exc}"
        except Exception as exc:
            found[what] = f"not a CheckpointError: {type(exc).__name__}: {exc}"

    for name in ds.__all__:
        attempt(name, lambda: getattr(ds, name))
    for module in ("engine", "reshard"):
        attempt(module, lambda: importlib.import_module(f"shardpoint.integrations.deepspeed.{module}"))
    print(json.dumps(found))
    """
)


def test_without_deepspeed_every_entry_point_names_the_extra():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(found) == {
        "EngineOptions",
        "SaveOnPreemption",
        "ShardpointCheckpointEngine",
        "load_checkpoint",
        "save_checkpoint",
        "use",
        "engine",
        "reshard",
    }
    for what, error in found.items():
        assert error.startswith("FrameworkMissingError: "), (what, error)
        assert "pip install 'shardpoint[deepspeed]'" in error, (what, error)
