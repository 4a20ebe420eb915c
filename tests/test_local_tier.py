"""The non-persistent local tier with peer replicas (``Checkpointer(local_dir=...)``, issue 22).

Pure rules first (placement, local_keep, markers), then real gloo processes where each
rank's "node" is its own directory (tests/distributed.py), then two real torchrun
agents joined by c10d rendezvous with node-local directories and the loopback S3
server as the persistent store (tests/multinode.py).
"""

from __future__ import annotations

import itertools
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

import shardpoint as sp
from shardpoint.catalog.metadata import FileRecord
from shardpoint.cli import main as cli_main
from shardpoint.tier.marker import LOCAL_MARKER, HeldCopy, LocalMarker, held_copies, run_dir_name
from shardpoint.tier.placement import Nodes, TierLayoutError, nodes_from_domains, place_replicas
from shardpoint.tier.retention import stale_copies
from tests import multinode, toy
from tests.distributed import launch

CONFIG = {"num_layers": toy.LAYERS, "hidden_size": toy.HIDDEN}
WORKER = str(Path(__file__).with_name("local_tier_worker.py"))


# ------------------------------------------------------------------ pure rules
@pytest.mark.parametrize(
    "members,replicas",
    [(((0,), (1,)), 1), (((0, 1), (2, 3), (4, 5)), 2), (((0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 10, 11)), 1)],
)
def test_placement_survives_any_lost_nodes(members, replicas):
    """Losing any ``replicas`` nodes leaves a copy of every rank's files; no copy on its owner's node."""
    nodes = Nodes(members)
    placement = place_replicas(nodes, replicas)
    for owner, holders in placement.items():
        assert len(holders) == replicas
        assert len({nodes.node_of(h) for h in holders} | {nodes.node_of(owner)}) == replicas + 1
    for lost in itertools.combinations(range(nodes.count), replicas):
        for owner, holders in placement.items():
            assert any(nodes.node_of(r) not in lost for r in (owner, *holders)), (lost, owner)
    load = [sum(r in h for h in placement.values()) for r in range(nodes.world_size)]
    assert set(load) == {replicas}  # equal nodes: every rank holds exactly R replicas


def test_placement_rejects_impossible_layouts():
    with pytest.raises(ValueError, match="needs at least 3 nodes"):
        place_replicas(Nodes(((0,), (1,))), 2)
    with pytest.raises(TierLayoutError, match="inconsistently"):
        nodes_from_domains([(0, 1), (1,)], "/nvme")
    assert nodes_from_domains([(0, 1), (0, 1), (2, 3), (2, 3)], "/nvme").members == ((0, 1), (2, 3))


def _copy(iteration: int, topology: dict | None = None) -> HeldCopy:
    marker = LocalMarker(iteration, 0, 2, topology or {"tp": 2, "pp": 1, "dp": 1}, ((0,), (1,)), {})
    return HeldCopy(iteration, 0, f"/x/{iteration}", marker)


def test_local_keep_deletes_old_abandoned_and_foreign_copies():
    def incompatible(m):
        return None if m.topology == {"tp": 2, "pp": 1, "dp": 1} else "other layout"

    copies = [_copy(i) for i in (2, 4, 6, 8, 12)] + [_copy(20, {"tp": 1, "pp": 1, "dp": 2})]
    doomed = {c.iteration for c in stale_copies(copies, latest=6, keep=2, incompatible=incompatible)}
    assert doomed == {2, 8, 12, 20}  # older than the 2 newest, an abandoned future, another layout
    doomed = {c.iteration for c in stale_copies(copies, 6, 2, incompatible, newer_only=True)}
    assert doomed == {8, 12}  # after a load only the abandoned future goes


def test_marker_is_non_persistent_and_round_trips():
    marker = LocalMarker(14, 1, 2, {"tp": 2, "pp": 1, "dp": 1}, ((0,), (1,)), {"state.pt": FileRecord(3, "ab")})
    data = json.loads(marker.to_json())
    assert data["persistent"] is False and data["tier"] == "local"
    assert LocalMarker.from_json(marker.to_json(), "m") == marker
    data["persistent"] = True
    with pytest.raises(sp.CorruptCheckpointError, match="not a valid local-tier marker"):
        LocalMarker.from_json(json.dumps(data), "m")


# --------------------------------------------------- gloo ranks, one "node" each
def _train(rank, world, base, steps, per_node, tp, env_fault=None, fault_step=None, keep=2):
    """Rank of a job whose nodes are ``base/node<k>`` (``per_node`` ranks each); loads, trains, saves."""
    import os

    logs: list[tuple[str, str]] = []
    handler = logging.Handler()
    handler.emit = lambda r: logs.append((r.levelname, r.getMessage()))
    logging.getLogger("shardpoint").addHandler(handler)
    logging.getLogger("shardpoint").setLevel(logging.INFO)
    topo = sp.Topology(tp, 1, world // tp)
    toy.seed_rng(topo, seed=999)
    state = toy.build(topo)
    ckpt = sp.Checkpointer(
        f"{base}/persistent",
        topology=topo,
        save_interval=10,
        config=CONFIG,
        local_dir=f"{base}/node{rank // per_node}",
        local_interval=2,
        local_keep=keep,
        local_replicas=1,
    )
    result = ckpt.load(state)
    if result is None:
        toy.seed_rng(topo)
    after_load = toy.snapshot(state)
    snaps, held = {}, {}
    for step in range((result.iteration if result else 0) + 1, steps + 1):
        toy.train_step(state, step)
        if step == fault_step:
            os.environ["SHARDPOINT_FAULT"] = env_fault
        ckpt.maybe_save(step, state)
        snaps[step] = toy.snapshot(state)
        ckpt.wait()  # wait() commits and replicates the local save too
        held[step] = sorted((c.iteration, c.owner) for c in held_copies(ckpt.local_tier.storage, ckpt.local_tier.root))
    times = ckpt.local_times
    ckpt.close()
    loaded = None if result is None else (result.iteration, result.tier, result.source, result.tiers)
    return {"loaded": loaded, "after_load": after_load, "snaps": snaps, "held": held, "logs": logs, "times": times}


def _run(node: Path, persistent: Path | str) -> Path:
    """A node's directory of the run whose persistent path is ``persistent`` (shardpoint.tier.marker)."""
    return node / run_dir_name(str(persistent))


def _same(a: dict, b: dict) -> None:
    assert a["tensors"].keys() == b["tensors"].keys()
    for key, (_, _, tensor) in a["tensors"].items():
        assert torch.equal(tensor, b["tensors"][key][2]), key
    assert a["lr"] == b["lr"] and a["sched"] == b["sched"] and a["extra"] == b["extra"]
    assert torch.equal(a["rng"], b["rng"])


def test_damaged_own_copy_falls_back_to_the_peer_replica(tmp_path):
    """2 nodes x 1 rank, tp=2 (different shards per rank): replicas over gloo; a damaged own copy -> the peer's."""
    base = tmp_path / "job"
    first = launch(_train, 2, str(base), 4, 1, 2)
    for r in first:  # wait() committed and replicated each save: both nodes hold both ranks' files
        assert r["held"][4] == [(2, 0), (2, 1), (4, 0), (4, 1)] and r["held"][3] == [(2, 0), (2, 1)]
        assert r["times"].saves == 2 and r["times"].last_replicated_bytes > 0
    markers = [json.loads(p.read_text()) for p in base.glob(f"node*/run-*/local_0000004/rank_*/{LOCAL_MARKER}")]
    assert len(markers) == 4 and len({m["save_id"] for m in markers}) == 1  # one save id, every copy of the save
    own = _run(base / "node1", base / "persistent") / "local_0000004/rank_00001/state.pt"
    data = bytearray(own.read_bytes())
    data[len(data) // 2] ^= 0xFF
    own.write_bytes(bytes(data))
    resumed = launch(_train, 2, str(base), 5, 1, 2)
    assert resumed[1]["loaded"][:2] == (4, "peer") and resumed[0]["loaded"][:2] == (4, "local")
    damaged = [m for lvl, m in resumed[1]["logs"] if lvl == "WARNING" and "damaged" in m]
    assert damaged and str(own.parent) in damaged[0]
    for before, after in zip(first, resumed):
        _same(before["snaps"][4], after["after_load"])


def test_crash_during_local_save_leaves_the_previous_one(tmp_path):
    """Invariant 1 per tier: a rank killed mid-write leaves 4 invisible; one killed mid-publish leaves 6 loadable."""
    base = tmp_path / "job"
    fault = "point=local-after-data,rank=1,action=kill"
    codes = launch(_train, 2, str(base), 8, 1, 2, fault, 6, expect_failure=True, timeout=60)
    assert codes[1] != 0
    node0, node1 = (_run(base / n, base / "persistent") for n in ("node0", "node1"))
    assert list((node1 / "local_0000006").glob(".shardpoint-tmp-*"))  # partial, invisible
    fault = "point=local-before-publish,rank=1,action=kill"
    codes = launch(_train, 2, str(base), 6, 1, 2, fault, 6, expect_failure=True, timeout=60)
    assert codes[1] != 0
    # rank 0 published its copy and rank 1's replica of 6, rank 1 died before publishing its own
    assert (node0 / "local_0000006/rank_00001" / LOCAL_MARKER).exists()
    assert not (node1 / "local_0000006/rank_00001").exists()
    final = launch(_train, 2, str(base), 7, 1, 2)
    assert [r["loaded"][:2] for r in final] == [(6, "local"), (6, "peer")]
    assert not list(base.glob("node*/run-*/local_*/.shardpoint-tmp-*"))  # leftovers removed at the start


def _save_with_failing_disk(rank, world, base):
    """Rank 1's local write fails at step 4 (an I/O error); every rank must raise, none may hang."""
    import os

    topo = sp.Topology(2, 1, 1)
    state = toy.build(topo)
    ckpt = sp.Checkpointer(
        f"{base}/persistent", topology=topo, local_dir=f"{base}/node{rank}", local_interval=2, config=CONFIG
    )
    caught = None
    for step in range(1, 5):
        toy.train_step(state, step)
        if step == 4:
            os.environ["SHARDPOINT_FAULT"] = "point=local-after-data,rank=1,action=raise"
        ckpt.maybe_save(step, state)
        try:
            ckpt.wait()
        except sp.CheckpointError as exc:
            caught = str(exc)
    os.environ.pop("SHARDPOINT_FAULT")
    ckpt.close()
    return caught


def test_a_failed_local_write_is_raised_on_every_rank(tmp_path):
    base = tmp_path / "job"
    caught = launch(_save_with_failing_disk, 2, str(base), timeout=60)
    assert "injected fault at local-after-data on rank 1" in caught[1]
    assert "rank(s) [1]" in caught[0]
    for node in ("node0", "node1"):  # 2 stays; nothing of 4 is left, committed or partial
        run = _run(base / node, base / "persistent")
        assert [p.relative_to(run).as_posix() for p in sorted(run.glob("local_*/*"))] == [
            "local_0000002/rank_00000",
            "local_0000002/rank_00001",
        ]


def test_other_layout_or_fewer_nodes_load_the_persistent_store(tmp_path):
    base = tmp_path / "job"
    launch(_train, 2, str(base), 13, 1, 2)
    for node in ("node0", "node1"):  # 10 was due for both tiers: saved persistently only
        assert sorted(p.name for p in _run(base / node, base / "persistent").glob("local_*")) == [
            "local_0000008",
            "local_0000012",
        ]
    assert (base / "persistent/iter_0000010/shardpoint.json").exists()
    fewer = launch(_train, 2, str(base), 10, 2, 2)  # the same two ranks on one node (both use node0)
    assert [r["loaded"][:2] for r in fewer] == [(10, "persistent"), (10, "persistent")]
    said = [m for lvl, m in fewer[0]["logs"] if lvl == "WARNING" and "local tier" in m]
    assert said and "node(s)" in said[0] and "persistent store" in said[0]
    # another layout: tp=1 dp=2
    relaid = launch(_train, 2, str(base), 10, 1, 1)
    assert [r["loaded"][:2] for r in relaid] == [(10, "persistent")] * 2
    said = [m for lvl, m in relaid[0]["logs"] if lvl == "WARNING" and "local tier" in m]
    assert said and "tp=2 pp=1 dp=1" in said[0]


def test_inspect_shows_local_checkpoints_as_non_persistent_and_prune_refuses(tmp_path, capsys):
    base = tmp_path / "job"
    launch(_train, 2, str(base), 4, 1, 2)
    assert cli_main(["inspect", str(base / "node0"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["persistent"] is False
    assert [(c["iteration"], c["ranks_held"], c["persistent"]) for c in report["checkpoints"]] == [
        (2, [0, 1], False),
        (4, [0, 1], False),
    ]
    assert cli_main(["prune", str(base / "node0"), "--keep-last", "1"]) != 0
    assert "non-persistent local-tier" in capsys.readouterr().err
    assert len(list((base / "node0").glob("run-*/local_*/rank_*"))) == 4  # nothing deleted


def test_single_process_and_no_local_arguments(tmp_path):
    """One process: the tier works without replicas; without local_* nothing changes."""
    topo = sp.Topology(1, 1, 1)
    state = toy.build(topo)
    plain = sp.Checkpointer(str(tmp_path / "plain"), topology=topo, save_interval=10)
    assert plain.local_tier is None and plain.local_times is None
    assert not plain.maybe_save(2, state)
    plain.close()
    with pytest.raises(ValueError, match="needs local_interval"):
        sp.Checkpointer(str(tmp_path / "p"), local_dir=str(tmp_path / "l"))
    with pytest.raises(ValueError, match="tiers never mix"):
        sp.Checkpointer(str(tmp_path / "p"), local_dir=str(tmp_path / "p"), local_interval=2)
    ckpt = sp.Checkpointer(str(tmp_path / "p"), topology=topo, local_dir=str(tmp_path / "l"), local_interval=2)
    for step in range(1, 5):
        toy.train_step(state, step)
        ckpt.maybe_save(step, state)
    ckpt.close()
    fresh = toy.build(topo)
    again = sp.Checkpointer(str(tmp_path / "p"), topology=topo, local_dir=str(tmp_path / "l"), local_interval=2)
    result = again.load(fresh)
    again.close()
    assert (result.iteration, result.tier, result.metadata.format) == (4, "local", "local")
    _same(toy.snapshot(state), toy.snapshot(fresh))


def _one_process_run(persistent: Path, local_dir: Path, steps: int, keep: int = 2):
    """One process: load (None or a result), then train and save locally every 2 steps up to ``steps``."""
    topo = sp.Topology(1, 1, 1)
    state = toy.build(topo)
    ckpt = sp.Checkpointer(
        str(persistent), topology=topo, local_dir=str(local_dir), local_interval=2, local_keep=keep, save_interval=100
    )
    result = ckpt.load(state)
    snaps = {}
    for step in range((result.iteration if result else 0) + 1, steps + 1):
        toy.train_step(state, step)
        ckpt.maybe_save(step, state)
        snaps[step] = toy.snapshot(state)
    ckpt.close()
    return result, snaps, toy.snapshot(state) if result else None


def test_a_damaged_newest_copy_falls_back_to_the_older_one_and_deletes_nothing(tmp_path, caplog):
    """Issue 34 item 3: local_keep=2, saves at 2 and 4, one flipped byte in 4: resumes at 2, 2 and 4 both stay."""
    _, snaps, _ = _one_process_run(tmp_path / "p", tmp_path / "l", 4)
    run = _run(tmp_path / "l", tmp_path / "p")
    newest = run / "local_0000004/rank_00000/state.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="shardpoint"):
        result, _, loaded = _one_process_run(tmp_path / "p", tmp_path / "l", 2)
    assert (result.iteration, result.tier) == (2, "local")
    _same(snaps[2], loaded)
    assert any("damaged" in m and str(newest.parent) in m for m in caplog.messages)
    assert sorted(p.name for p in run.glob("local_*")) == ["local_0000002", "local_0000004"]  # nothing deleted


def test_another_runs_local_copies_are_never_loaded_nor_deleted(tmp_path, caplog):
    """Issue 34 item 4: runA and runB share local_dir; empty runB starts fresh, runA's copies stay and still load."""
    shared = tmp_path / "local"
    _, snaps_a, _ = _one_process_run(tmp_path / "runA", shared, 4)
    with caplog.at_level(logging.WARNING, logger="shardpoint"):
        result_b, _, _ = _one_process_run(tmp_path / "runB", shared, 6, keep=1)
    assert result_b is None  # before the fix: runA's iteration 4
    assert any("another run" in m and str(tmp_path / "runA") in m for m in caplog.messages), caplog.messages
    run_a, run_b = _run(shared, tmp_path / "runA"), _run(shared, tmp_path / "runB")
    assert sorted(p.name for p in run_a.glob("local_*")) == ["local_0000002", "local_0000004"]
    assert sorted(p.name for p in run_b.glob("local_*")) == ["local_0000006"]  # runB's keep=1 pruned only its own
    result_a, _, loaded = _one_process_run(tmp_path / "runA", shared, 4)
    assert (result_a.iteration, result_a.tier) == (4, "local")
    _same(snaps_a[4], loaded)
    marker = json.loads((run_a / "local_0000004/rank_00000" / LOCAL_MARKER).read_text())
    assert marker["run"] == str(tmp_path / "runA") and marker["save_id"]


def test_copies_of_two_saves_of_one_iteration_never_mix():
    """Issue 34 item 5: rank 0's copy of one save of 4 and rank 1's of another are not a checkpoint; 2 is next."""
    from shardpoint.tier.choose import Offer, plan

    nodes = Nodes(((0,), (1,)))

    def offer(iteration, owner, save_id):
        return Offer(iteration, owner, owner, f"/n{owner}/{iteration}/{save_id}", {}, "{}", None, save_id)

    mixed = [offer(4, 0, "b"), offer(4, 1, "a"), offer(2, 0, "x"), offer(2, 1, "x")]
    candidates, _ = plan(mixed, nodes, newer_than=-1)
    assert [c.save for c in candidates] == [(2, "x")]
    again = [*mixed, offer(4, 1, "b"), offer(4, 0, "a")]  # both saves of 4 complete: the later save first
    assert [c.save for c in plan(again, nodes, newer_than=-1)[0]] == [(4, "b"), (4, "a"), (2, "x")]
    assert plan(mixed[:2], nodes, newer_than=-1)[0] == []


# ------------------------------------------- two torchrun agents, loopback S3
def _restart(dirs: list[str], out: Path, steps: int, persistent: str, env: dict, *extra: str) -> list[dict]:
    nodes = multinode.start_job(dirs, 1, _worker_args(steps, persistent, *extra), out, env)
    multinode.wait_job(nodes)
    return multinode.results(out, 2)


def _worker_args(steps: int, persistent: str, *extra: str) -> list[str]:
    return ["--tp=2", "--dp=1", f"--steps={steps}", f"--persistent={persistent}", *extra]


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_node_replaced_resumes_from_the_local_tier(s3_server, bucket, tmp_path, monkeypatch):
    """2 torchrun agents x 1 rank (tp=2: each rank holds other shards); persistent every 10 on S3, local every 2.

    The first run trains to 15 with saves, then on to 17 without saving (the uninterrupted
    reference), and both agents are SIGKILLed: the disks hold what a loss at step 15
    leaves (local 12 and 14 on both nodes, persistent 10). Then:
    1. node 1's local_dir emptied (a replacement node): resumes at 14 from the local tier,
       node 1's rank taking its files from node 0's copy over the process group,
       bit-identical at 14 and through 17;
    2. a flipped byte in the copy on node 0 that the replaced node needs: named, and
       the job falls back to the next older local checkpoint, 12 (issue 34 item 3);
    3. in that same job, both local dirs wiped and a new Checkpointer: 10 from the
       persistent store (S3).
    """
    monkeypatch.setattr(multinode, "WORKER", WORKER)
    persistent = f"{bucket}/run"
    dirs = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    out = tmp_path / "first"
    nodes = multinode.start_job(dirs, 1, _worker_args(17, persistent, "--stop-saving-after=15"), out, s3_server.env)
    multinode.wait_for([out / f"result_{r}.pt" for r in range(2)], nodes)
    for node in nodes:
        node.kill()
    first = multinode.results(out, 2)
    replaced = next(r["rank"] for r in first if r["node_dir"] == dirs[1])
    for d in dirs:  # local_keep=2 per node, each its own rank's copy and the other's replica; 10 went to S3 only
        assert sorted(
            p.relative_to(_run(Path(d), persistent)).as_posix() for p in Path(d).glob("run-*/local_*/rank_*")
        ) == [
            "local_0000012/rank_00000",
            "local_0000012/rank_00001",
            "local_0000014/rank_00000",
            "local_0000014/rank_00001",
        ]
    pristine = tmp_path / "pristine0"
    shutil.copytree(dirs[0], pristine)

    # 1. node 1 replaced by one with an empty local_dir
    shutil.rmtree(dirs[1])
    resumed = _restart(dirs, tmp_path / "replaced", 17, persistent, s3_server.env)
    for before, after in zip(first, resumed):
        assert after["loaded"]["iteration"] == 14
        _same(before["steps"][14], after["loaded"]["snapshot"])
        for step in (15, 16, 17):
            _same(before["steps"][step], after["steps"][step])
        expected = "peer" if after["node_dir"] == dirs[1] else "local"
        assert after["loaded"]["tier"] == expected, after["loaded"]
        assert after["loaded"]["tiers"] == resumed[0]["loaded"]["tiers"]
    on_node1 = next(r for r in resumed if r["node_dir"] == dirs[1])
    server = next(r["rank"] for r in resumed if r["node_dir"] == dirs[0])
    assert f"rank {server} ({_run(Path(dirs[0]), persistent)}/local_0000014/" in on_node1["loaded"]["source"]
    assert (_run(Path(dirs[1]), persistent) / "local_0000016").is_dir()  # the replaced node saves (and holds) again

    # 2. the copy the replaced node needs is damaged: named, then the next older local checkpoint
    shutil.rmtree(dirs[0])
    shutil.rmtree(dirs[1])
    shutil.copytree(pristine, dirs[0])
    needed = _run(Path(dirs[0]), persistent) / "local_0000014" / f"rank_{replaced:05d}"
    _flip_byte(needed / "state.pt")
    fallback = _restart(dirs, tmp_path / "damaged", 10, persistent, s3_server.env, "--then-wipe-and-reload")
    for r in fallback:  # 12 from the local tier: node 0's own copies, the replaced node's over the process group
        expected = "peer" if r["node_dir"] == dirs[1] else "local"
        assert (r["loaded"]["iteration"], r["loaded"]["tier"]) == (12, expected)
    warnings = [m for r in fallback for level, m in r["messages"] if level == "WARNING"]
    assert any(str(needed) in m and "damaged" in m for m in warnings), warnings
    assert any("next older local checkpoint" in m for m in warnings)
    # 3. both local dirs wiped: the persistent store on S3
    assert [(r["reloaded"]["iteration"], r["reloaded"]["tier"]) for r in fallback] == [(10, "persistent")] * 2
    assert all(r["reloaded"]["source"].startswith("s3://") for r in fallback)
    for before, after in zip(first, fallback):
        _same(before["steps"][12], after["loaded"]["snapshot"])
        _same(before["steps"][10], after["reloaded"]["snapshot"])


def test_frozen_tensors_unchanged_since_the_last_local_save_are_linked_not_written(tmp_path):
    """Issue 39 item 3, the local tier: a frozen base goes into frozen.pt, hard-linked to the previous copy's
    while unchanged; the newest copy loads exactly after the older ones are pruned, and a base changed in place
    is written again."""
    from tests.test_dedup import frozen_state, step

    topo = sp.Topology(1, 1, 1)
    state = frozen_state(topo)
    persistent, local = tmp_path / "p", tmp_path / "l"

    def checkpointer() -> sp.Checkpointer:
        return sp.Checkpointer(
            str(persistent), topology=topo, local_dir=str(local), local_interval=1, local_keep=2, save_interval=100
        )

    ckpt = checkpointer()
    inodes, snaps = {}, {}
    for it in (1, 2, 3):
        step(state, it)
        ckpt.maybe_save(it, state)
        ckpt.wait()
        snaps[it] = toy.snapshot(state)
        copy = _run(local, persistent) / f"local_{it:07d}/rank_00000"
        inodes[it] = (copy / "frozen.pt").stat().st_ino
    assert inodes[1] == inodes[2] == inodes[3]  # one file on disk for three copies
    assert (_run(local, persistent) / "local_0000003/rank_00000/frozen.pt").stat().st_nlink == 2  # 2 kept
    assert not (_run(local, persistent) / "local_0000001").exists()  # pruned: only its link went
    with torch.no_grad():
        next(p for p in state.model.parameters() if not p.requires_grad).add_(1.0)  # the base changes in place
    step(state, 4)
    ckpt.maybe_save(4, state)
    ckpt.close()
    snaps[4] = toy.snapshot(state)
    assert (_run(local, persistent) / "local_0000004/rank_00000/frozen.pt").stat().st_ino != inodes[3]
    for it in (4, 3):  # the newest, then an explicit older one (which deletes nothing)
        fresh = frozen_state(topo)
        for p in fresh.model.parameters():
            p.data.zero_()
        again = checkpointer()
        result = again.load(fresh, iteration=it) if it == 3 else again.load(fresh)
        again.close()
        assert (result.iteration, result.tier) == (it, "local")
        _same(snaps[it], toy.snapshot(fresh))
