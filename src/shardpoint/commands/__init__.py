"""Subcommands of the ``shardpoint`` CLI; each module exposes ``add_parser(subparsers)``."""
