"""The ``shardpoint`` command line: one subcommand per module, registered here.

Each subcommand module exposes ``add_parser(subparsers)`` (which sets ``func`` on its
parser) and keeps its logic importable for tests. Exit codes: 0 ok, 1 a problem was
found (damaged checkpoint, failed check), 2 usage errors (argparse's own code).
Errors that shardpoint raises on purpose are printed as one sentence, not a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from shardpoint._version import __version__
from shardpoint.errors import CheckpointError

__all__ = ["main"]

# name -> module providing add_parser(); imported lazily so `shardpoint --help` is fast.
SUBCOMMANDS = {
    "demo": "shardpoint.demo.launch",
    "inspect": "shardpoint.commands.inspect",
    "verify": "shardpoint.commands.verify",
    "convert": "shardpoint.commands.convert",
    "export": "shardpoint.commands.export",
    "prune": "shardpoint.commands.prune",
    "diff": "shardpoint.commands.diff",
    "bench": "shardpoint.bench",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardpoint", description="Checkpoints for model-parallel PyTorch training.")
    parser.add_argument("--version", action="version", version=f"shardpoint {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        try:
            importlib.import_module(module).add_parser(sub)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            sub.add_parser(name, help="(not available in this version)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    logging.basicConfig(
        level=logging.WARNING if getattr(args, "quiet", False) else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
