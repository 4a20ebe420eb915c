"""What every subcommand prints: rich tables for people, JSON for scripts, nothing when quiet.

Rules shared by all commands:

* ``--json`` prints exactly one JSON document on stdout and nothing else there
  (logs and progress go to stderr), so ``shardpoint verify DIR --json | jq`` works.
* ``--quiet`` prints only problems and errors; the exit code says the rest.
* Progress bars are drawn on stderr, and only when both stdout and stderr are
  terminals and neither ``--quiet`` nor ``--json`` was given.
* Every JSON document carries ``"schema_version"`` (:data:`SCHEMA_VERSION`), raised
  when a field changes meaning or goes away (new fields do not raise it).
* Exit codes (kept stable for scripts): 0 ok; 1 damage or a problem found (a damaged or
  partial checkpoint, a failed check, an I/O error); 2 a usage error: a bad option, or a
  path that is not a checkpoint (missing, a file, another tool's checkpoint:
  :class:`~shardpoint.errors.NotACheckpointError`). Errors shardpoint raises on purpose
  (:class:`~shardpoint.errors.CheckpointError`) reach ``shardpoint.cli.main``, which
  prints them as one line; bad option values (``ValueError``) and I/O errors are turned
  into one line here. With ``--json`` an error is also one JSON document on stdout:
  ``{"schema_version", "ok": false, "exit_code", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from shardpoint.errors import CheckpointError, CheckpointNotFoundError, NotACheckpointError

__all__ = [
    "EXIT_OK",
    "EXIT_PROBLEM",
    "EXIT_USAGE",
    "SCHEMA_VERSION",
    "Output",
    "add_output_flags",
    "exit_code_for",
    "guarded",
    "human_bytes",
    "human_time",
    "jsonable",
    "new_table",
    "plain_help",
    "report_error",
]

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2
SCHEMA_VERSION = 1  # of every JSON document the CLI prints
_PIPE_WIDTH = 160  # wide enough that tables piped to a file or `less` keep file names on one line


def add_output_flags(parser: argparse.ArgumentParser) -> None:
    """``--json`` and ``--quiet``, the same on every subcommand."""
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout (for scripts)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print only problems; no progress bars")


class Output:
    """Where a command's output goes, decided once from ``--json`` / ``--quiet`` and the terminal."""

    def __init__(self, args: argparse.Namespace):
        self.json = bool(getattr(args, "json", False))
        self.quiet = bool(getattr(args, "quiet", False))
        interactive = sys.stdout.isatty()
        width = None if interactive or "COLUMNS" in os.environ else _PIPE_WIDTH
        self.console = Console(width=width, highlight=False)
        self.stderr = Console(stderr=True, highlight=False)
        self.show_progress = interactive and sys.stderr.isatty() and not (self.json or self.quiet)

    def print(self, *objects: Any) -> None:
        """Human output: skipped with ``--json`` or ``--quiet``."""
        if not (self.json or self.quiet):
            self.console.print(*objects)

    def problem(self, text: str) -> None:
        """A problem found: printed even with ``--quiet`` (not with ``--json``, whose document lists it)."""
        if not self.json:
            self.console.print(text, markup=False, soft_wrap=True)

    def emit_json(self, data: Mapping[str, Any]) -> None:
        if self.json:
            print(json.dumps({"schema_version": SCHEMA_VERSION, **jsonable(data)}, indent=2, sort_keys=False))

    @contextlib.contextmanager
    def progress(self) -> Iterator[Callable[[str, int, int], None]]:
        """A ``progress(phase, done, total)`` callback drawing one bar per phase (a no-op when quiet)."""
        if not self.show_progress:
            yield lambda phase, done, total: None
            return
        columns = (TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=self.stderr, transient=True) as bar:
            tasks: dict[str, Any] = {}

            def update(phase: str, done: int, total: int) -> None:
                if phase not in tasks:
                    tasks[phase] = bar.add_task(phase, total=total)
                bar.update(tasks[phase], completed=done, total=total)

            yield update


def guarded(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn a bad option value (ValueError) into exit 2 and an I/O error into exit 1, each one line.

    A closed output pipe ends the command silently (exit 1), as ``grep`` or ``cat`` do.
    """

    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except BrokenPipeError:
            # the reader went away (`| head`): stop quietly; point stdout at /dev/null so the
            # interpreter's final flush does not raise again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_PROBLEM
        except ValueError as exc:
            return report_error(args, str(exc), EXIT_USAGE, "ValueError")
        except CheckpointError:
            raise  # shardpoint.cli.main reports it, with its exit code
        except OSError as exc:
            where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
            return report_error(args, f"{exc.strerror or exc}{where}", EXIT_PROBLEM, type(exc).__name__)

    return run


def exit_code_for(exc: CheckpointError) -> int:
    """2 for a path that is not a checkpoint (nothing is damaged: the path is wrong), else 1."""
    return EXIT_USAGE if isinstance(exc, (NotACheckpointError, CheckpointNotFoundError)) else EXIT_PROBLEM


def report_error(args: argparse.Namespace | None, message: str, code: int, kind: str) -> int:
    """Print an error as one line on stderr and, with ``--json``, as a JSON document on stdout; return ``code``."""
    print(f"error: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        error = {"type": kind, "message": message}
        print(json.dumps({"schema_version": SCHEMA_VERSION, "ok": False, "exit_code": code, "error": error}, indent=2))
    return code


def plain_help(doc: str | None) -> str:
    """A module docstring as ``--help`` text: RST roles and literals as plain words (``:mod:`x``` -> ``x``)."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc or "")
    text = re.sub(r"``([^`]+)``", r"\1", text)
    return re.sub(r"::$", ":", text, flags=re.MULTILINE)


def new_table(*columns: str, title: str | None = None) -> Table:
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False, box=None, header_style="bold")
    for name in columns:
        table.add_column(name, overflow="fold")
    return table


def human_bytes(n: int | float) -> str:
    if n < 1024:
        return f"{int(n)} B"
    exponent = min(int(math.log(n, 1024)), 5)
    return f"{n / 1024**exponent:.1f} {'BKMGTP'[exponent]}{'B' if exponent == 0 else 'iB'}"


def human_time(timestamp: float | None) -> str:
    if not timestamp:
        return "-"
    return datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S")


def jsonable(value: Any) -> Any:
    """Plain JSON types for anything a checkpoint's common state may hold (tensors become summaries)."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        if getattr(value, "numel", lambda: 2)() == 1 and len(value.shape) == 0:
            return jsonable(value.item())
        return {"tensor": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
    return repr(value)
