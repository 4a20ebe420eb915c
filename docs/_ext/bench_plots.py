"""``{bench-plot} bench/NAME.json``: plots of what ``shardpoint bench --json`` measured, drawn at build time.

The figures are committed as the bench printed them (``docs/bench/*.json``), so the plots
cannot disagree with the numbers, and re-measuring is one command: run the bench again with
``--json`` into the same file. The PNGs go to ``docs/_generated/`` (not committed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.parsers.rst import Directive

# the operations compared in the timing panel, in the order a reader meets them
OPERATIONS = [
    "sequential write+fsync",
    "torch.save per rank",
    "dcp save",
    "shardpoint save",
    "shardpoint async stall",
    "torch.load per rank",
    "dcp load",
    "shardpoint load",
    "shardpoint load (resharded)",
]


def render(reports: list[dict[str, Any]], png: Path) -> None:
    """Seconds per operation (median, min–max) and every ratio against its target, one column per directory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(reports), figsize=(7.5 * len(reports), 9), squeeze=False)
    for column, report in enumerate(reports):
        _timings(axes[0][column], report)
        _ratios(axes[1][column], report)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)


def _timings(ax: Any, report: dict[str, Any]) -> None:
    rows = {row["name"]: row for row in report["rows"]}
    names = [name for name in OPERATIONS if name in rows]
    medians = [rows[n]["median_s"] for n in names]
    below = [m - rows[n]["min_s"] for n, m in zip(names, medians)]
    above = [rows[n]["max_s"] - m for n, m in zip(names, medians)]
    colors = ["tab:blue" if n.startswith("shardpoint") else "tab:gray" for n in names]
    ax.barh(names, medians, xerr=[below, above], color=colors)
    ax.invert_yaxis()
    size = report["size_bytes"] / 1e9
    ax.set_title(
        f"{report['dir']}\n{size:.2f} GB over {report['ranks']} ranks, median of {report['repeat']}", fontsize=10
    )
    ax.set_xlabel("seconds (bars: median; lines: min–max)")


def _ratios(ax: Any, report: dict[str, Any]) -> None:
    checks = report["ratios"]
    names = list(checks)
    values = [checks[n]["value"] for n in names]
    ax.barh(names, values, color=["tab:green" if checks[n]["met"] else "tab:red" for n in names])
    targets = [float(checks[n]["target"].split()[-1]) for n in names]
    ax.scatter(targets, names, marker="|", s=300, color="black", label="target", zorder=3)
    ax.invert_yaxis()
    ax.set_title("ratios (green: target met, red: not)", fontsize=10)
    ax.legend(loc="lower right")


class BenchPlot(Directive):
    required_arguments = 1  # the JSON file, relative to the page

    def run(self) -> list[nodes.Node]:
        env = self.state.document.settings.env
        source = Path(env.doc2path(env.docname)).parent / self.arguments[0]
        env.note_dependency(str(source))
        png = Path(env.srcdir) / "_generated" / f"{source.stem}.png"
        render(json.loads(source.read_text()), png)
        return [nodes.image(uri=f"/_generated/{png.name}", alt=f"shardpoint bench: {source.name}")]


def setup(app: Any) -> dict[str, Any]:
    app.add_directive("bench-plot", BenchPlot)
    return {"parallel_read_safe": True}
