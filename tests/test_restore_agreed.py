"""Issue 54 defect 8: a restore that fails on one rank (RNG, scheduler, ``TrainState.stateful``) fails on every rank.

The restore runs inside the load's last agreement round (``restores_in_last_round``) for
the ``dist`` format and the local tier, in an agreement of its own for the ``torch``
format; either way no rank returns success from a load another rank failed, and every
rank's CheckpointError names the rank and the item (invariant 17). Real gloo processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import xxhash

import shardpoint as sp
from tests import toy
from tests.distributed import launch


class _Loader:
    """A data loader's position, as ``TrainState.stateful`` holds it; ``refuse``: its load_state_dict raises."""

    def __init__(self, position: int, refuse: bool = False):
        self.position, self.refuse = position, refuse

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, saved: dict) -> None:
        if self.refuse:
            raise ValueError("this sampler was built for another dataset")
        self.position = saved["position"]


def _state(topo: sp.Topology, rank: int, refuse: bool = False) -> sp.TrainState:
    state = toy.build(topo)
    state.stateful["loader"] = _Loader(100 + rank, refuse)
    return state


def _outcome(fn) -> str:
    """``"ok"``, or the CheckpointError's message (anything else is the defect: a raw error on one rank)."""
    try:
        fn()
    except sp.CheckpointError as exc:
        return f"CheckpointError: {exc}"
    except Exception as exc:  # noqa: BLE001 - recorded: the test asserts there is none
        return f"raw {type(exc).__name__}: {exc}"
    return "ok"


def _save(rank: int, world: int, root: str, fmt: str) -> None:
    topo = sp.Topology(1, 1, world)
    state = _state(topo, rank)
    toy.train_step(state, 1)
    sp.Checkpointer(root, topology=topo, format=fmt).save(1, state)


def _load(rank: int, world: int, root: str, refuse_on: int | None) -> str:
    topo = sp.Topology(1, 1, world)
    state = _state(topo, rank, refuse=rank == refuse_on)
    ckpt = sp.Checkpointer(root, topology=topo)
    outcome = _outcome(lambda: ckpt.load(state))
    ckpt.close()  # a collective: a rank that walked on after "success" would leave the other waiting
    return outcome


def _assert_agreed(outcomes: list[str], item: str) -> None:
    assert all(o.startswith("CheckpointError") for o in outcomes), outcomes
    for o in outcomes:
        assert "rank 1" in o and item in o, o


def _rewrite_listed(root: Path, name: str, data: bytes) -> None:
    """Replace a file of checkpoint 1 and its record in the marker: only the content is bad."""
    (root / "iter_0000001" / name).write_bytes(data)
    marker = root / "iter_0000001" / "shardpoint.json"
    meta = json.loads(marker.read_text())
    meta["files"][name] = {"size": len(data), "xxh3_64": xxhash.xxh3_64_hexdigest(data)}
    marker.write_text(json.dumps(meta))


def test_a_crafted_rng_state_on_one_rank_fails_the_load_on_every_rank(tmp_path):
    launch(_save, 2, str(tmp_path), "dist")
    rng_file = tmp_path / "iter_0000001" / "rng" / "rank_00001.pt"
    saved = torch.load(rng_file, weights_only=True)
    saved["rng"] = {k: v for k, v in saved["rng"].items() if k != "python"}  # loads, checksums, cannot restore
    crafted = tmp_path / "crafted.pt"
    torch.save(saved, crafted)
    _rewrite_listed(tmp_path, "rng/rank_00001.pt", crafted.read_bytes())
    outcomes = launch(_load, 2, str(tmp_path), None, timeout=90)
    _assert_agreed(outcomes, "RNG state (rng)")
    assert "KeyError" in outcomes[1] and "load_rng=False" in outcomes[1]


def test_a_stateful_failing_on_one_rank_fails_the_load_on_every_rank(tmp_path):
    for fmt in ("dist", "torch"):
        launch(_save, 2, str(tmp_path / fmt), fmt)
        outcomes = launch(_load, 2, str(tmp_path / fmt), 1, timeout=90)
        _assert_agreed(outcomes, "TrainState.stateful['loader']")
        assert "another dataset" in outcomes[1], (fmt, outcomes)
        assert launch(_load, 2, str(tmp_path / fmt), None) == ["ok", "ok"], fmt


def _local_tier(rank: int, world: int, base: str) -> str:
    topo = sp.Topology(1, 1, world)

    def checkpointer() -> sp.Checkpointer:
        return sp.Checkpointer(
            f"{base}/persistent", topology=topo, save_interval=100, local_dir=f"{base}/node{rank}", local_interval=1
        )

    state, ckpt = _state(topo, rank), checkpointer()
    toy.train_step(state, 1)
    ckpt.maybe_save(1, state)
    ckpt.close()
    fresh, again = _state(topo, rank, refuse=rank == 1), checkpointer()
    outcome = _outcome(lambda: again.load(fresh))
    again.close()
    return outcome


def test_a_stateful_failing_on_one_rank_fails_a_local_tier_load_on_every_rank(tmp_path):
    outcomes = launch(_local_tier, 2, str(tmp_path), timeout=90)
    _assert_agreed(outcomes, "TrainState.stateful['loader']")
