"""Publisher -> catalog -> receiver across processes: real NIXL (UCX loopback), real gRPC."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from mx_refit.errors import FailedPrecondition, NotFound, TransferError
from mx_refit.receive.receiver import Receiver
from tests import _trainer_proc

pytestmark = pytest.mark.timeout(180)


class Trainers:
    def __init__(self, address: str, model: str, ranks: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(ranks):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_trainer_proc.run, args=(address, model, rank, ranks, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.pids = [self._expect(c, "ready") for c in self.conns]

    @staticmethod
    def _expect(conn, kind, timeout=120):
        if not conn.poll(timeout):
            raise TimeoutError(f"no {kind!r} from trainer")
        got, payload = conn.recv()
        if got == "error":
            raise RuntimeError(payload)
        assert got == kind, (got, payload)
        return payload

    def all(self, cmd, arg, reply):
        for c in self.conns:
            c.send((cmd, arg))
        return [self._expect(c, reply) for c in self.conns]

    def close(self):
        for c, p in zip(self.conns, self.procs):
            if p.is_alive():
                c.send(("stop", None))
            p.join(10)
            if p.is_alive():
                p.kill()


@pytest.fixture
def trainers(mx_catalog, mx_model_name):
    t = Trainers(mx_catalog, mx_model_name, 2)
    yield t
    t.close()


def test_two_ranks_three_cycles_byte_exact_and_no_new_registrations(trainers, mx_catalog, mx_model_name):
    engine: dict[str, torch.Tensor] = {}
    with Receiver(mx_catalog, mx_model_name, engine=engine) as rec:
        for version in (1, 2, 3):
            if version > 1:
                assert trainers.all("drain", (version - 1, 10), "drained") == [True, True]
            published = trainers.all("publish", (version, 100 + version), "published")
            assert sorted(state for state, _ in published) == ["PENDING", "READY"]  # the last rank completes it
            result = rec.refit(min_version=version, wait_s=10)
            assert result.version.version == version
            expected = _trainer_proc.full_tensors(100 + version)
            assert {n for n, _ in result.tensors} == set(expected)
            for name, tensor in result.tensors:
                assert torch.equal(tensor, expected[name]), name
                assert torch.equal(engine[name], expected[name]), name
            s = result.stats
            assert s.bytes_pulled == s.bytes_needed == sum(t.numel() * t.element_size() for t in expected.values())
            assert s.sources == 2
            if version == 1:
                first_registrations = [r for _, r in published]
                assert s.new_registrations == 1  # the receive arena, once
            else:
                assert s.new_registrations == 0
                assert [r for _, r in published] == first_registrations  # trainers: zero new registrations


def test_drain_waits_for_live_lease(trainers, mx_catalog, mx_model_name):
    trainers.all("publish", (1, 7), "published")
    with Receiver(mx_catalog, mx_model_name) as rec:
        info = rec.discover(1)
        lease = rec.client.acquire_lease(model=mx_model_name, version=1, reader_id="slow-reader", ttl_s=30)
        verdicts = trainers.all("drain", (1, 0.5), "drained")
        assert all("live reader leases" in str(v) for v in verdicts)
        with pytest.raises(FailedPrecondition, match="DRAINING"):
            rec.refit(1)  # retired: no new leases
        rec.client.release_lease(lease_id=lease)
        assert trainers.all("drain", (1, 5), "drained") == [True, True]
        assert info.version == 1


def test_dead_source_fails_the_pull_and_leaves_weights_untouched(trainers, mx_catalog, mx_model_name):
    engine: dict[str, torch.Tensor] = {}
    with Receiver(mx_catalog, mx_model_name, engine=engine, transfer_timeout_s=3) as rec:
        trainers.all("publish", (1, 11), "published")
        rec.refit(1)
        before = {n: t.clone() for n, t in engine.items()}
        trainers.all("drain", (1, 5), "drained")
        trainers.all("publish", (2, 12), "published")
        trainers.procs[1].kill()  # rank 1 dies after publishing v2, before anyone pulled
        trainers.procs[1].join(10)
        started = time.monotonic()
        with pytest.raises((TransferError, FailedPrecondition, NotFound)) as err:
            rec.refit(2)
        assert time.monotonic() - started < 60
        if isinstance(err.value, TransferError):
            assert "tp1" in str(err.value)  # names the source that failed
        for name, tensor in engine.items():
            assert torch.equal(tensor, before[name]), f"{name} changed by a failed refit"


def test_unknown_and_not_ready_versions_are_clear_errors(trainers, mx_catalog, mx_model_name):
    with Receiver(mx_catalog, mx_model_name) as rec:
        with pytest.raises(NotFound, match=mx_model_name):
            rec.refit(1)
        trainers.conns[0].send(("publish", (1, 5)))  # only rank 0 of 2: stays PENDING
        assert trainers._expect(trainers.conns[0], "published")[0] == "PENDING"
        with pytest.raises(FailedPrecondition, match="PENDING"):
            rec.refit(1)
        with pytest.raises((NotFound, FailedPrecondition)):
            rec.refit(min_version=1, wait_s=0.3)


def test_adjacent_but_separately_registered_tensors_are_never_merged(mx_catalog, mx_model_name):
    """Back-to-back allocations are separate NIXL regions: one descriptor spanning both fails.

    ``torch.from_numpy`` on two halves of one array gives two storages that touch in memory,
    exactly what the CUDA caching allocator or safetensors produce for real parameters.
    """
    import numpy as np

    from mx_refit.publisher import Publisher
    from mx_refit.types import PublishedTensor

    backing = np.arange(2 * 4096, dtype=np.float32)
    first, second = torch.from_numpy(backing[:4096]), torch.from_numpy(backing[4096:])
    assert first.data_ptr() + first.nbytes == second.data_ptr()
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    with Publisher(mx_catalog, mx_model_name) as pub, Receiver(mx_catalog, mx_model_name) as rec:
        pub.publish(1, [PublishedTensor("a", first), PublishedTensor("b", second)])
        assert len(rec.discover(1).sources[0].regions) == 2
        result = rec.refit(1)
        got = dict(result.tensors)
        assert torch.equal(got["a"], first) and torch.equal(got["b"], second)
        assert result.stats.descriptors == 2  # adjacent on both sides, but two regions
