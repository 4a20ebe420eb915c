"""``python -m shardpoint.integrations.megatron SCRIPT ARGS``: run a Megatron-LM script with shardpoint installed.

Under ``torchrun`` as Megatron's own scripts are. ``SCRIPT`` runs as ``__main__`` with
``sys.argv`` = ``[SCRIPT, *ARGS]`` and its folder first on ``sys.path`` (Megatron-LM's
``pretrain_gpt.py`` imports ``megatron.training`` and ``gpt_builders`` from there).
``SHARDPOINT_MEGATRON_PRELUDE=module`` imports a module first (the tests' CPU stand-ins).
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys

from shardpoint.errors import FrameworkMissingError

from . import install


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    script = os.path.abspath(argv[0])
    prelude = os.environ.get("SHARDPOINT_MEGATRON_PRELUDE")
    if prelude:  # before the script's folder goes first on the path (Megatron-LM has a tests/ of its own)
        module = importlib.import_module(prelude)
        if hasattr(module, "install"):
            module.install()
    sys.path.insert(0, os.path.dirname(script))
    try:
        install()
    except FrameworkMissingError as exc:  # what to install, without a traceback
        raise SystemExit(f"error: {exc}") from exc
    sys.argv = [script, *argv[1:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
