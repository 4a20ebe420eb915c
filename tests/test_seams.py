"""The seams as a matrix: stores × features × faults (issue 54, "tests that find the next ones").

Each cell is a real job (two gloo ranks, each its own node) with one feature (stored
once, the local tier with a replica, node-local parts uploaded with ``upload_to``, async
saves) on one store (local disk, ``s3://``, ``gs://``, ``az://``, each a real emulator),
that saves iterations 1 and 2 and then meets one fault: SIGKILL in the middle of a
commit, a re-save of an existing iteration killed midway, two jobs committing the same
iteration at once, a lost node, a flipped byte in the newest checkpoint, or a full disk.
After it, a restart must find:

* the tracker names a loadable checkpoint (``load()`` succeeds), unless the fault damaged
  that very checkpoint, which is then refused by name;
* ``load(fallback=True)`` returns the newest intact checkpoint, bit for bit equal to a
  replay of the training that wrote it (:func:`tests.seam_matrix.replay`);
* nothing intact is deleted (iterations 1 and 2 keep their markers);
* nothing shardpoint did not write is touched (a user's file in the store is unchanged).

CI runs every pair of values at least once (24 cells, pairwise: each store meets each
fault, and each feature meets each store and each fault); ``SHARDPOINT_SEAMS_FULL=1``
runs the full product (96 cells).
"""

from __future__ import annotations

import itertools
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import fsspec
import pytest

from tests import seam_matrix
from tests.distributed import launch

STORES = ["local", "s3", "gs", "az"]
FEATURES = ["stored-once", "local-tier", "upload_to", "async"]
FAULTS = ["kill", "resave", "race", "lost-node", "flip", "full-disk"]
USER_FILE = "notes-from-the-user.txt"

if os.environ.get("SHARDPOINT_SEAMS_FULL"):
    CELLS = list(itertools.product(STORES, FEATURES, FAULTS))
else:  # pairwise: the feature shifts with store and fault, so every pair of values meets at least once
    CELLS = [(s, FEATURES[(i + j) % len(FEATURES)], f) for i, s in enumerate(STORES) for j, f in enumerate(FAULTS)]

BASE_RUN = [(1, 0), (2, 0)]


def _store(kind: str, tmp_path: Path, request: Any, monkeypatch: Any) -> tuple[str, dict[str, str]]:
    if kind == "local":
        return str(tmp_path / "store" / "run"), {}
    server = request.getfixturevalue(f"{kind}_server")
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    name = "seam-" + "".join(c for c in request.node.name.lower() if c.isalnum())[-40:]
    bucket = server.make_bucket(name)
    bucket = bucket if "://" in bucket else f"{kind}://{bucket}"
    return f"{bucket}/run", server.env


def _fs(url: str) -> tuple[Any, str]:
    return fsspec.core.url_to_fs(url)


def _commit_point(store: str, feature: str) -> str:
    if feature == "local-tier":
        return "local-before-publish"
    if feature == "upload_to":
        return "during-upload"
    return "before-marker" if store == "local" else "mid-switch"


def _markers(url: str) -> set[int]:
    fs, root = _fs(url)
    found = set()
    for it in (1, 2, 3):
        if fs.exists(f"{root}/iter_{it:07d}/shardpoint.json"):
            found.add(it)
    return found


def _flip_newest(url: str) -> None:
    fs, root = _fs(url)
    data = sorted(p for p in fs.ls(f"{root}/iter_0000002", detail=False) if p.endswith(".distcp"))[0]
    raw = bytearray(fs.cat_file(data))
    raw[len(raw) // 2] ^= 0xFF
    fs.pipe_file(data, bytes(raw))


def _run(fn: Any, *args: Any, env: dict[str, str], fail_ok: bool = False) -> list[Any] | None:
    if fail_ok:
        launch(fn, 2, *args, env=env, expect_failure=True, timeout=120)
        return None
    return launch(fn, 2, *args, env=env, timeout=120)


@pytest.mark.parametrize(("store", "feature", "fault"), CELLS, ids=["-".join(c) for c in CELLS])
def test_seam(store, feature, fault, tmp_path, request, monkeypatch):
    url, env = _store(store, tmp_path, request, monkeypatch)
    base = str(tmp_path / "job")
    first = _run(seam_matrix.train, base, url, feature, {"steps": BASE_RUN, "persistent": {1, 2}}, env=env)
    assert all(r["error"] is None and r["saved"] == [1, 2] for r in first), first
    fs, root = _fs(url)
    fs.pipe_file(f"{root}/{USER_FILE}", b"mine, not shardpoint's")
    candidates: dict[int, dict[str, list]] = {1: {"base": BASE_RUN[:1]}, 2: {"base": BASE_RUN}}
    floor, damaged = 2, None
    kill = f"point={_commit_point(store, feature)},rank=1,action=kill"

    if fault == "kill":  # SIGKILL on rank 1 in the middle of committing iteration 3
        plan = {"steps": [(3, 0)], "fault_at": 3, "fault": kill}
        _run(seam_matrix.train, base, url, feature, plan, env=env, fail_ok=True)
        candidates[3] = {"base": [*BASE_RUN, (3, 0)]}
    elif fault == "resave":  # rolled back to 1, iteration 2 saved again (other data) and killed midway
        plan = {"steps": [(2, 100)], "fault_at": 2, "fault": kill, "load_iteration": 1, "persistent": {2}}
        _run(seam_matrix.train, base, url, feature, plan, env=env, fail_ok=True)
        candidates[2]["resaved"] = [(1, 0), (2, 100)]
    elif fault == "race":  # two jobs commit iteration 3 at the same instant
        gate = tmp_path / "gate"
        gate.mkdir()
        results: dict[str, Any] = {}

        def job(who: str, variant: int) -> None:
            plan = {"steps": [(3, variant)], "persistent": {3}, "race_at": 3, "gate": str(gate), "who": who}
            try:
                results[who] = _run(seam_matrix.train, f"{base}-{who}", url, feature, plan, env=env)
            except AssertionError as failure:  # a rank died: reported below with the other job's outcome
                results[who] = [{"error": f"rank failure: {failure}"[:2000], "saved": []}]

        threads = [threading.Thread(target=job, args=(w, v)) for w, v in (("a", 0), ("b", 200))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        outcomes = {who: {r["error"] is None for r in ranks} for who, ranks in results.items()}
        assert all(len(o) == 1 for o in outcomes.values()), f"ranks of one job disagree: {results}"
        winners = [who for who, o in outcomes.items() if o == {True}]
        assert len(winners) == 1, f"exactly one of two writers must win: {results}"
        loser = results[{"a": "b", "b": "a"}[winners[0]]]
        errors = [str(r["error"])[:300] for r in loser]
        assert all(e.startswith("ConcurrentSaveError") for e in errors), errors
        candidates[3] = {winners[0]: [*BASE_RUN, (3, 0 if winners[0] == "a" else 200)]}
        floor = 3
    elif fault == "lost-node":  # iteration 3 saved, then node 1 loses its disk
        _run(seam_matrix.train, base, url, feature, {"steps": [(3, 0)]}, env=env)
        shutil.rmtree(f"{base}/node1", ignore_errors=True)
        candidates[3] = {"base": [*BASE_RUN, (3, 0)]}
        floor = 3  # nothing is lost: the local tier holds a replica of node 1 on node 0, upload_to the store
    elif fault == "flip":  # a flipped byte in the newest checkpoint's data on the store
        _flip_newest(url)
        floor, damaged = 1, 2
    elif fault == "full-disk":  # rank 1's disk fills in the middle of writing iteration 3
        point = "local-after-data" if feature == "local-tier" else "mid-data"
        plan = {"steps": [(3, 0)], "fault_at": 3, "fault": f"point={point},rank=1,action=raise,errno=ENOSPC"}
        out = _run(seam_matrix.train, base, url, feature, plan, env=env)
        errors = [r["error"] for r in out]
        if feature != "local-tier":  # every failure reaches every rank (a local-tier save only logs and goes on)
            assert all(errors) and all("3" in e or "rank 1" in e for e in errors), out
        candidates[3] = {"base": [*BASE_RUN, (3, 0)]}

    found = _run(seam_matrix.check, base, url, feature, candidates, env=env)
    strict, fallback = (r[False] for r in found), [r[True] for r in found]
    for got in fallback:
        assert got["error"] is None and got["iteration"] is not None, f"fallback found nothing: {found}"
        assert got["iteration"] >= floor, f"newest intact is {floor} or later: {found}"
        assert got["matches"], f"iteration {got['iteration']} is not what training wrote: {found}"
    assert len({(g["iteration"], tuple(g["matches"])) for g in fallback}) == 1, found
    for got in strict:
        if damaged is not None and got["error"] is not None:
            assert "Corrupt" in got["error"] or "damaged" in got["error"].lower(), got
        else:
            assert got["error"] is None and got["matches"], f"the tracker must name a loadable checkpoint: {found}"
    kept = _markers(url)
    assert {1, 2} <= kept, f"an intact checkpoint was deleted: markers left {sorted(kept)}"
    assert fs.cat_file(f"{root}/{USER_FILE}") == b"mine, not shardpoint's"
