"""The ``shardpoint`` command line: one subcommand per module, registered here.

Each subcommand module exposes ``add_parser(subparsers)`` (which sets ``func`` on its
parser) and keeps its logic importable for tests. Only the module of the subcommand
asked for is imported, so ``shardpoint --help`` and ``--version`` never import torch.

Exit codes, kept for scripts: 0 fine; 1 damage or a problem found; 2 a usage error or a
path that is not a checkpoint (:class:`~shardpoint.errors.NotACheckpointError`). Errors
that shardpoint raises on purpose are printed as one sentence, not a traceback; with
``--json`` also as one JSON document on stdout (see :mod:`shardpoint.commands._output`).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from shardpoint._version import __version__
from shardpoint.commands import EXIT_USAGE, exit_code_for, report_error
from shardpoint.errors import CheckpointError

__all__ = ["SUBCOMMANDS", "build_parser", "main"]

# name -> (module providing add_parser(), one-line help shown by `shardpoint --help`)
SUBCOMMANDS = {
    "demo": ("shardpoint.demo.launch", "train a tp/pp/dp GPT on local CPU ranks: preempt, resume, reshard"),
    "inspect": ("shardpoint.commands.inspect", "list the checkpoints in a directory, or describe one"),
    "verify": ("shardpoint.commands.verify", "check files, sizes and checksums of checkpoints"),
    "convert": ("shardpoint.commands.convert", "convert between formats, layouts and tp/pp (offline)"),
    "export": (
        "shardpoint.commands.export",
        "export model weights: safetensors, a release checkpoint, or Hugging Face",
    ),
    "prune": ("shardpoint.commands.prune", "delete old checkpoints (keep the last N, every K-th)"),
    "diff": ("shardpoint.commands.diff", "compare the tensors of two checkpoints (any formats and layouts)"),
    "bench": ("shardpoint.bench", "measure save/load speed against the disk's limits and baselines"),
}

EXIT_CODES = """exit codes:
  0  fine
  1  damage or a problem found (a damaged or partial checkpoint, a failed check, an I/O error)
  2  usage error, or a path that is not a checkpoint (missing, a file, another tool's checkpoint)
"""


class _UsageError(Exception):
    """argparse's complaint, raised instead of its exit so ``main`` can report it (as JSON with ``--json``)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        raise _UsageError(f"{self.prog}: {message}")


def build_parser(commands: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser (``commands=None``), or one whose subcommands other than ``commands`` are stubs.

    A stub has its name and help line only: ``shardpoint --help`` lists every command
    without importing any of them.
    """
    parser = _Parser(
        prog="shardpoint",
        description="Checkpoints for model-parallel PyTorch training.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"shardpoint {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        if commands is not None and name not in commands:
            sub.add_parser(name, help=help_text, add_help=False)
            continue
        try:
            importlib.import_module(module).add_parser(sub)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            sub.add_parser(name, help="(not available in this version)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser([chosen] if chosen in SUBCOMMANDS else [])
    try:
        args = parser.parse_args(argv)
    except _UsageError as exc:
        return report_error(argparse.Namespace(json="--json" in argv), str(exc), EXIT_USAGE, "UsageError")
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    logging.basicConfig(
        level=logging.WARNING if getattr(args, "quiet", False) else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except CheckpointError as exc:
        return report_error(args, str(exc), exit_code_for(exc), type(exc).__name__)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
