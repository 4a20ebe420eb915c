"""``shardpoint diff``: which tensors differ between two checkpoints, and by how much.

Both sides are read whole with :func:`shardpoint.offline.read_full` (checksums
verified first), so a ``torch`` checkpoint at tp=2 compares with a ``dist`` one at
tp=1: tensors are compared at full size under their global keys. Reported: keys
only in one side, shape or dtype changes, and the maximum absolute difference of
each tensor whose values differ by more than ``--atol`` (default 0: bit-exact,
NaN equal to NaN). Exit 1 when anything differs.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from typing import Any

import torch

from shardpoint import offline
from shardpoint.commands._other_tools import refuse_other_tool
from shardpoint.commands._output import EXIT_OK, EXIT_PROBLEM, Output, add_output_flags, guarded, new_table

__all__ = ["add_parser", "compare", "run"]

EXAMPLES = """examples:
  shardpoint diff runs/a runs/b                          # the tracker's checkpoint of each
  shardpoint diff runs/gpt/iter_0000100 runs/gpt/iter_0000200 --atol 1e-6 --json
"""


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "diff",
        help="compare the tensors of two checkpoints (any formats and layouts)",
        description="Compare two checkpoints tensor by tensor at full size. Exit 1 when they differ.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("a", metavar="A", help="a save directory or one checkpoint")
    parser.add_argument("b", metavar="B", help="a save directory or one checkpoint")
    parser.add_argument(
        "--atol",
        type=float,
        default=0.0,
        metavar="X",
        help="largest absolute difference still counted as equal (default 0: exact)",
    )
    add_output_flags(parser)
    parser.set_defaults(func=run)


def compare(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], atol: float = 0.0) -> dict[str, Any]:
    """Keys only in ``a`` or ``b``, and per common key whether and how much it differs."""
    if atol < 0 or math.isnan(atol):
        raise ValueError(f"--atol must be >= 0, got {atol}")
    changed: list[dict[str, Any]] = []
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        if x.shape != y.shape or x.dtype != y.dtype:
            changed.append(
                {
                    "key": key,
                    "reason": f"{tuple(x.shape)} {_dtype(x)} -> {tuple(y.shape)} {_dtype(y)}",
                    "max_abs_diff": None,
                }
            )
        elif not torch.equal(x, y):
            diff = _max_abs_diff(x, y)
            if not (diff <= atol):  # NaN in one side only counts as a difference
                changed.append({"key": key, "reason": "values", "max_abs_diff": diff})
    return {
        "only_in_a": sorted(set(a) - set(b)),
        "only_in_b": sorted(set(b) - set(a)),
        "changed": changed,
        "compared": len(set(a) & set(b)),
    }


def _max_abs_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    if x.dtype == torch.bool:
        x, y = x.to(torch.int8), y.to(torch.int8)
    wide = torch.complex128 if x.is_complex() else torch.float64
    delta = (x.to(wide) - y.to(wide)).abs()
    both_nan = torch.isnan(x.to(wide)).logical_and(torch.isnan(y.to(wide)))
    delta = delta.masked_fill(both_nan, 0.0) if both_nan.any() else delta
    return float(delta.max()) if delta.numel() else 0.0


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


@guarded
def run(args: argparse.Namespace) -> int:
    out = Output(args)
    refuse_other_tool(args.a, "diff")
    refuse_other_tool(args.b, "diff")
    with out.progress() as progress:
        left = offline.read_full(args.a, progress=lambda phase, done, total: progress(f"{phase} A", done, total))
        right = offline.read_full(args.b, progress=lambda phase, done, total: progress(f"{phase} B", done, total))
    report = compare(left.tensors, right.tensors, args.atol)
    differ = bool(report["only_in_a"] or report["only_in_b"] or report["changed"])
    out.emit_json({"a": left.path, "b": right.path, "atol": args.atol, "identical": not differ, **report})
    if report["changed"]:
        table = new_table("tensor", "max |a-b|", "change", title=f"{len(report['changed'])} tensor(s) differ")
        for row in report["changed"]:
            value = "-" if row["max_abs_diff"] is None else f"{row['max_abs_diff']:.6g}"
            table.add_row(row["key"], value, row["reason"])
        out.print(table)
    for side, path in (("a", left.path), ("b", right.path)):
        for key in report[f"only_in_{side}"]:
            out.problem(f"only in {side.upper()} ({path}): {key}")
    if differ:
        out.problem(
            f"{left.path} and {right.path} differ: {len(report['changed'])} changed, "
            f"{len(report['only_in_a'])} only in A, {len(report['only_in_b'])} only in B"
        )
        return EXIT_PROBLEM
    out.print(f"{report['compared']} tensors identical" + (f" within atol={args.atol:g}" if args.atol else ""))
    return EXIT_OK
