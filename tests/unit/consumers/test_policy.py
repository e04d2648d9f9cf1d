"""duebox.consumers.policy: the worker's public decisions from the paces
its handlers have shown — which jobs may share a transaction, when a
batched handler is a straggler, how much work a thread takes in hand.

Kept to the decisions (the worker's runner is being reshaped around them);
what they do to a running worker is tests/test_group_commit.py's and
tests/test_batch_lane.py's."""

from __future__ import annotations

import types
from typing import Any

import pytest

from duebox.consumers import policy as policy_module
from duebox.consumers.policy import Policy
from duebox.message import ORDERING_KEY_HEADER
from duebox.tasks import Task


def task(name: str = "t", **changes: Any) -> Task:
    def handler(payload: Any, ctx: Any) -> None:
        return None

    return Task(name=name, fn=changes.pop("fn", handler), queue="default", **changes)


def learnt(pace: float, *, group: int = 32, runs: int = 1) -> Policy:
    p = Policy(concurrency=8, group=group)
    for _ in range(runs):
        p.ran("t", pace, batched=True)
    return p


def test_a_task_is_short_only_once_its_handlers_showed_it() -> None:
    p = Policy(concurrency=8, group=32)
    assert not p.short(task())
    assert not p.laneable(task(), None)
    p.ran("t", 0.001, batched=False)
    assert p.short(task())
    assert p.laneable(task(), None)
    p.ran("slow", 1.0, batched=False)
    assert not p.short(task("slow"))


async def async_handler(payload: Any, ctx: Any) -> None:
    return None


@pytest.mark.parametrize("alone", [
    task(group_commit=False), task(timeout=5.0), task(fn=async_handler)])
def test_what_must_run_alone_never_shares_a_transaction(alone: Task) -> None:
    p = learnt(0.001)
    assert not p.groups(alone)
    assert not p.laneable(alone, None)
    assert not learnt(0.001, group=1).groups(task())  # group commit off


def test_an_ordering_key_keeps_its_line_off_the_batch_lane() -> None:
    p = learnt(0.001)
    assert p.laneable(task(), {ORDERING_KEY_HEADER: ""})
    assert not p.laneable(task(), {ORDERING_KEY_HEADER: "acct-1"})
    assert not p.laneable(None, None)


def test_run_times_are_smoothed_and_a_stragglers_run_is_left_out() -> None:
    p = learnt(0.010)
    p.ran("t", 0.020, batched=True)
    assert p.task_pace["t"] == pytest.approx(0.8 * 0.010 + 0.2 * 0.020)
    assert p.pace == pytest.approx(p.task_pace["t"])
    straggler = p.straggler_after("t")
    assert straggler == max(policy_module.STRAGGLER_AFTER, 4 * p.task_pace["t"])
    before = dict(p.task_pace)
    p.ran("t", straggler * 10, batched=True)
    assert p.task_pace == before
    p.ran("t", 0.001, batched=False)  # an unbatched run teaches the task, not the batch pace
    assert p.pace == pytest.approx(before["t"])
    assert p.task_pace["t"] < before["t"]


def test_a_task_whose_straggler_held_its_batch_runs_alone_for_a_while(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(policy_module, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    p = learnt(0.001)
    p.held_batch("t")
    assert p.isolated("t")
    assert not p.groups(task())
    now[0] += policy_module.ISOLATE_FOR
    assert not p.isolated("t")
    assert p.groups(task())


@pytest.mark.parametrize(("pace", "group", "extra"), [
    (None, 32, 1),  # cautious until it has seen batched handlers
    (0.001, 32, 32),  # 50 fit the budget: at most a group
    (0.010, 32, 5),
    (1.0, 32, 1),  # at least one
    (0.001, 1, 0),  # group commit off
])
def test_work_in_hand_per_free_thread(pace: float | None, group: int, extra: int) -> None:
    p = Policy(concurrency=8, group=group) if pace is None else learnt(pace, group=group)
    assert p.extra_per_thread() == extra


def test_two_batches_at_once_for_short_handlers_every_thread_after_a_straggler(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [50.0]
    monkeypatch.setattr(policy_module, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    short, slow = learnt(0.0001), learnt(0.01)
    assert (short.batches_at_once(8), short.batches_at_once(1), short.batches_at_once(0)) == (
        2, 1, 0)
    assert slow.batches_at_once(8) == 8  # a full group would outrun the budget
    short.straggled()
    assert short.straggling()
    assert short.batches_at_once(8) == 8
    now[0] += policy_module.SPREAD_FOR
    assert not short.straggling()
    assert short.batches_at_once(8) == 2


@pytest.mark.parametrize(("waiting", "threads", "size"), [
    (100, 4, 25), (100, 1, 32), (3, 8, 1), (0, 2, 1), (9, 0, 9),
])
def test_a_batch_takes_its_share_of_what_waits_at_most_a_group(waiting: int, threads: int,
                                                                size: int) -> None:
    assert Policy(concurrency=8, group=32).batch_size(waiting, threads) == size
