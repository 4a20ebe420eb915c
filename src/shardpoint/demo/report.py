"""What ``shardpoint demo`` shows at the end: a table of its phases and a plot of their losses.

Each phase's losses are compared with the uninterrupted reference run at the same
iterations: a resume at the same layout must be *bit-identical* (weights, optimizer,
data position and every RNG stream were restored); a resume at another layout is
only close, because per-rank dropout streams cannot carry over to ranks that hold
different shards (and reductions round differently).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console, JustifyMethod
from rich.table import Table

__all__ = ["PhaseReport", "Recovery", "compare_losses", "plot_losses", "render_table", "summary_json"]


@dataclass
class Recovery:
    """A node failure and what each tier brought back (``demo --nnodes 2 --local-interval N``).

    Without the local tier the job would resume from ``persistent_iteration`` (what the
    object store's tracker named when the nodes died); with it, from ``local_iteration``.
    The steps lost are those trained after it up to ``killed_after``, done again on restart.
    """

    killed_after: int
    persistent_interval: int
    persistent_iteration: int
    local_interval: int
    local_iteration: int
    tiers: dict[int, tuple[str, str]]  # rank -> (tier, source), LoadResult.tiers of the restart

    @property
    def steps_lost_without_tier(self) -> int:
        return self.killed_after - self.persistent_iteration

    @property
    def steps_lost_with_tier(self) -> int:
        return self.killed_after - self.local_iteration


@dataclass
class PhaseReport:
    """One phase of the demo, as shown in the closing table."""

    name: str
    layout: tuple[int, int, int]
    losses: dict[int, float]
    save_seconds: float
    bytes_written: int
    wall_seconds: float
    comparison: str = "-"
    note: str = ""
    exit_codes: list[int | None] = field(default_factory=list)
    recovery: Recovery | None = None

    @property
    def layout_text(self) -> str:
        tp, pp, dp = self.layout
        return f"tp={tp} pp={pp} dp={dp}"

    @property
    def layout_short(self) -> str:
        return "×".join(map(str, self.layout))

    @property
    def steps_text(self) -> str:
        if not self.losses:
            return "-"
        return f"{min(self.losses)}-{max(self.losses)}"

    @property
    def final_loss(self) -> float | None:
        return self.losses[max(self.losses)] if self.losses else None


def compare_losses(losses: Mapping[int, float], reference: Mapping[int, float]) -> str:
    """``"bit-identical"`` when every shared iteration's loss is equal, else the largest difference."""
    shared = [i for i in losses if i in reference]
    if not shared:
        return "-"
    diff = max(abs(losses[i] - reference[i]) for i in shared)
    return "bit-identical" if diff == 0.0 else f"max |Δ| {diff:.1e}"


def render_table(phases: Sequence[PhaseReport], console: Console) -> None:
    """Print the closing table (phase, layout, steps, loss, comparison, save seconds, GB written), then notes."""
    table = Table(title="shardpoint demo", title_justify="left")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("phase", "left"),
        ("tp×pp×dp", "left"),
        ("steps", "right"),
        ("loss", "right"),
        ("vs uninterrupted", "left"),
        ("save s", "right"),
        ("GB written", "right"),
    )
    for column, justify in columns:
        table.add_column(column, justify=justify, no_wrap=True)
    for phase in phases:
        loss = f"{phase.final_loss:.4f}" if phase.final_loss is not None else "-"
        table.add_row(
            phase.name,
            phase.layout_short,
            phase.steps_text,
            loss,
            phase.comparison,
            f"{phase.save_seconds:.2f}",
            f"{phase.bytes_written / 1e9:.4f}",
        )
    console.print(table)
    for phase in phases:
        if phase.note:
            console.print(f"  {phase.name}: {phase.note}", highlight=False)
    for phase in phases:
        if phase.recovery is not None:
            _render_recovery(phase.recovery, console)


def _render_recovery(recovery: Recovery, console: Console) -> None:
    """The steps lost at the node failure with the local tier and without it, then where each rank loaded from."""
    table = Table(title=f"node failure after it {recovery.killed_after}", title_justify="left")
    for column in ("tier", "saved every", "resumes from it", "steps lost"):
        table.add_column(column, justify="left" if column == "tier" else "right", no_wrap=True)
    table.add_row(
        "without the local tier (object store)",
        str(recovery.persistent_interval),
        str(recovery.persistent_iteration),
        str(recovery.steps_lost_without_tier),
    )
    table.add_row(
        "with the local tier",
        str(recovery.local_interval),
        str(recovery.local_iteration),
        str(recovery.steps_lost_with_tier),
    )
    console.print(table)
    console.print("  where each rank loaded from (LoadResult.tier: source):", highlight=False)
    for rank, (tier, source) in sorted(recovery.tiers.items()):
        console.print(f"  rank {rank}: {tier}: {source}", highlight=False)


def summary_json(phases: Sequence[PhaseReport], extra: Mapping[str, object]) -> str:
    """The phases (losses included) and ``extra`` as JSON, for ``--json``."""
    data = {**extra, "phases": [_phase_json(p) for p in phases]}
    return json.dumps(data, indent=1)


def _phase_json(phase: PhaseReport) -> dict[str, Any]:
    data = {**asdict(phase), "losses": {str(k): v for k, v in phase.losses.items()}}
    recovery = phase.recovery
    if recovery is not None:
        lost = {"with_tier": recovery.steps_lost_with_tier, "without_tier": recovery.steps_lost_without_tier}
        data["recovery"] = {**data["recovery"], "steps_lost": lost}
    return data


def plot_losses(phases: Sequence[PhaseReport], reference: Mapping[int, float], path: str) -> None:
    """Write the uninterrupted, resumed and resharded loss curves to ``path`` (PNG).

    Without matplotlib (the ``demo`` extra) no plot is drawn: the table says everything the
    demo checks, and a warning names the extra that adds the plot.
    """
    try:
        import matplotlib
    except ImportError:
        logging.getLogger(__name__).warning(
            "matplotlib is not installed, so no %s; pip install 'shardpoint[demo]' adds the plot", path
        )
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    its = sorted(reference)
    ax.plot(its, [reference[i] for i in its], color="0.6", linewidth=3, label="uninterrupted", zorder=1)
    for phase in phases:
        xs = sorted(phase.losses)
        if xs:
            ax.plot(
                xs,
                [phase.losses[i] for i in xs],
                marker=".",
                markersize=4,
                linewidth=1,
                label=f"{phase.name} ({phase.layout_text})",
                zorder=2,
            )
            if xs[0] > 1:
                ax.axvline(xs[0] - 0.5, color="0.8", linestyle="--", linewidth=0.8)
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss")
    ax.set_title("Preempted, resumed and resharded vs uninterrupted")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def phase_progress(console: Any, show: bool, width: int = 22) -> Any:
    """The demo's progress bars: one per phase, with its loss; quiet when not a terminal."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn(f"{{task.description:<{width}}}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeElapsedColumn(),
        console=console,
        disable=not (show and console.is_terminal),
    )
