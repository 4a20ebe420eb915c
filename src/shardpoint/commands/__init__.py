"""Subcommands of the ``shardpoint`` CLI; each module exposes ``add_parser(subparsers)``.

What ``shardpoint.cli`` needs of the shared output rules (exit codes, errors as JSON)
is re-exported here; the rules live in :mod:`shardpoint.commands._output`.
"""

from shardpoint.commands._output import (
    EXIT_OK,
    EXIT_PROBLEM,
    EXIT_USAGE,
    SCHEMA_VERSION,
    exit_code_for,
    plain_help,
    report_error,
)

__all__ = ["EXIT_OK", "EXIT_PROBLEM", "EXIT_USAGE", "SCHEMA_VERSION", "exit_code_for", "plain_help", "report_error"]
