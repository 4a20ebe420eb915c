"""``.. shardpoint-cli::``: every subcommand's ``--help``, generated from ``shardpoint.cli.build_parser()``.

The reference cannot drift from the parser: the text is what ``shardpoint COMMAND --help``
prints, one section per subcommand.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from docutils import nodes
from docutils.parsers.rst import Directive


class ShardpointCli(Directive):
    has_content = False

    def run(self) -> list[nodes.Node]:
        from shardpoint.cli import build_parser

        os.environ.setdefault("COLUMNS", "100")  # argparse wraps help at the terminal's width
        parser = build_parser()
        sections: list[nodes.Node] = [nodes.literal_block(text=parser.format_help())]
        for name, sub in _subparsers(parser).items():
            section = nodes.section(ids=[f"shardpoint-{name}"])
            section += nodes.title(text=f"shardpoint {name}")
            section += nodes.literal_block(text=sub.format_help())
            sections.append(section)
        return sections


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def setup(app: Any) -> dict[str, Any]:
    app.add_directive("shardpoint-cli", ShardpointCli)
    return {"parallel_read_safe": True, "version": "1"}
