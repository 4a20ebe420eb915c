"""Save-decision and preservation policies: pure logic, no disk, no process group."""

import pytest

from shardpoint.lifecycle.policy import (
    AnySaveDecision,
    BestN,
    CheckpointInfo,
    EveryNMinutes,
    EveryNSteps,
    KeepEvery,
    LatestN,
    select_for_deletion,
)


def infos(*iterations, metrics=None):
    return [CheckpointInfo(i, (metrics or {}).get(i, {})) for i in iterations]


def test_every_n_steps():
    policy = EveryNSteps(100)
    assert [i for i in range(0, 401, 50) if policy.should_save(i, 0, 0)] == [100, 200, 300, 400]


def test_every_n_minutes_counts_from_last_save():
    policy = EveryNMinutes(2)
    assert not policy.should_save(5, now=1000 + 119, last_save_time=1000)
    assert policy.should_save(5, now=1000 + 120, last_save_time=1000)


def test_any_of_save_decisions():
    policy = AnySaveDecision((EveryNSteps(10), EveryNMinutes(1)))
    assert policy.should_save(10, 0, 0)
    assert policy.should_save(3, 61, 0)
    assert not policy.should_save(3, 30, 0)


def test_latest_n_keeps_newest():
    assert select_for_deletion(infos(1, 2, 3, 4, 5), [LatestN(2)], set()) == [1, 2, 3]


def test_keep_every_survives_latest_n():
    doomed = select_for_deletion(infos(100, 200, 300, 400, 500), [LatestN(1), KeepEvery(200)], set())
    assert doomed == [100, 300]


def test_protected_is_never_deleted():
    assert select_for_deletion(infos(1, 2, 3), [LatestN(1)], {1}) == [2]


def test_no_policy_keeps_everything():
    assert select_for_deletion(infos(1, 2, 3), [], set()) == []


@pytest.mark.parametrize("mode,kept", [("min", {2, 4}), ("max", {1, 3})])
def test_best_n(mode, kept):
    metrics = {1: {"loss": 3.0}, 2: {"loss": 1.0}, 3: {"loss": 2.5}, 4: {"loss": 1.5}, 5: {}}
    assert BestN(2, "loss", mode).should_preserve(infos(1, 2, 3, 4, 5, metrics=metrics)) == kept


def test_best_n_with_latest():
    metrics = {1: {"loss": 0.1}, 2: {"loss": 5.0}, 3: {"loss": 4.0}}
    assert select_for_deletion(infos(1, 2, 3, metrics=metrics), [LatestN(1), BestN(1, "loss")], set()) == [2]


@pytest.mark.parametrize(
    "bad",
    [
        lambda: EveryNSteps(0),
        lambda: LatestN(0),
        lambda: KeepEvery(-1),
        lambda: BestN(1, "x", "median"),
        lambda: EveryNMinutes(0),
    ],
)
def test_invalid_policies_raise(bad):
    with pytest.raises(ValueError):
        bad()
