"""Receiver.stage / Receiver.commit: the next version is pulled while the engine keeps its
weights, then loaded in one step; a failed stage or a commit without one changes nothing."""

from __future__ import annotations

import pytest
import torch

from mx_refit.errors import FailedPrecondition, NotFound
from mx_refit.hookspecs import hookimpl
from mx_refit.receive.receiver import Receiver
from tests import _trainer_proc
from tests.receive.test_refit import Trainers

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def trainers(mx_catalog, mx_model_name):
    t = Trainers(mx_catalog, mx_model_name, 2)
    yield t
    t.close()


def test_stage_keeps_the_engine_then_commit_loads(trainers, mx_catalog, mx_model_name):
    engine: dict[str, torch.Tensor] = {}
    done: list[int] = []
    with Receiver(mx_catalog, mx_model_name, engine=engine) as rec:
        rec.hooks.register(_Done(done))
        trainers.all("publish", (1, 101), "published")
        rec.refit(1)
        v1 = {n: t.clone() for n, t in engine.items()}
        trainers.all("drain", (1, 10), "drained")
        trainers.all("publish", (2, 102), "published")

        staged = rec.stage(2)
        assert rec.staged is staged and staged.version.version == 2
        for name, tensor in engine.items():  # staged, not loaded: the engine serves version 1
            assert torch.equal(tensor, v1[name]), name
        assert done == [1]  # refit_done fires at the commit, not at the stage

        committed = rec.commit()
        expected = _trainer_proc.full_tensors(102)
        for name, tensor in engine.items():
            assert torch.equal(tensor, expected[name]), name
        assert rec.staged is None and done == [1, 2]
        assert committed.stats.phase_seconds["commit"] >= 0
        assert "load" not in committed.stats.phase_seconds  # the pull did not load
        with pytest.raises(FailedPrecondition, match="without a staged version"):
            rec.commit()  # already committed


def test_failed_stage_leaves_weights_and_nothing_staged(trainers, mx_catalog, mx_model_name):
    engine: dict[str, torch.Tensor] = {}
    with Receiver(mx_catalog, mx_model_name, engine=engine) as rec:
        trainers.all("publish", (1, 7), "published")
        rec.stage(1)
        with pytest.raises(NotFound):
            rec.stage(5)  # no such version: what was staged is gone (the arena is reused)
        assert rec.staged is None and engine == {}
        with pytest.raises(FailedPrecondition):
            rec.commit()
        rec.stage(1)
        rec.refit(1)  # a refit replaces the staged version (it rewrites the arena)
        assert rec.staged is None
        expected = _trainer_proc.full_tensors(7)
        assert all(torch.equal(engine[n], t) for n, t in expected.items())


class _Done:
    def __init__(self, seen: list[int]) -> None:
        self.seen = seen

    @hookimpl
    def mx_refit_refit_done(self, stats) -> None:
        self.seen.append(stats.version)
