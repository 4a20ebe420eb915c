"""Megatron-LM's ``pretrain_gpt.py`` WITHOUT shardpoint, on CPU ranks: Megatron's own checkpoints.

``torchrun ... -m tests.integration_megatron_native $MLM_SRC/pretrain_gpt.py ARGS`` installs the
CPU stand-ins (:mod:`tests.integration_megatron_cpu`) and runs the script unchanged as
``__main__``, as the launcher does but without installing shardpoint. ``scripts/megatron-check``
uses it to write a Megatron-native ``torch_dist`` checkpoint that a run through the launcher
then loads under ``--load``.
"""

from __future__ import annotations

import os
import runpy
import sys

from tests import integration_megatron_cpu


def main(argv: list[str]) -> None:
    integration_megatron_cpu.install()  # before the script's folder goes first (Megatron-LM has a tests/ too)
    script = os.path.abspath(argv[0])
    sys.path.insert(0, os.path.dirname(script))
    sys.argv = [script, *argv[1:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
