"""CUDA IPC refits between two processes on one node (GPU machines only:
``pytest -m gpu tests/transport/test_transport_ipc_gpu.py``). The trainer process and this
(receiver) process share GPU 0, as in colocated training; NIXL is not needed.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from mx_refit.errors import ChecksumMismatch, TransferError  # noqa: E402
from mx_refit.receive.receiver import Receiver  # noqa: E402
from tests import _gpu_trainer  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda:0"
EXTRA = 2 << 20


class Trainer:
    def __init__(self, address: str, model: str, extra_bytes: int = EXTRA, checksums: bool = False) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_gpu_trainer.run, args=(address, model, DEVICE, child, extra_bytes, checksums),
                                daemon=True)
        self.proc.start()
        self.pid = self.expect("ready")

    def expect(self, kind: str, timeout: float = 120) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"no {kind!r} from the trainer")
        got, payload = self.conn.recv()
        if got == "error":
            raise RuntimeError(payload)
        assert got == kind, (got, payload)
        return payload

    def do(self, cmd: str, arg: Any, reply: str) -> Any:
        self.conn.send((cmd, arg))
        return self.expect(reply)

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("stop", None))
            self.proc.join(15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


@pytest.fixture
def trainer(mx_catalog: str, mx_model_name: str):
    t = Trainer(mx_catalog, mx_model_name)
    yield t
    t.close()


def check(result: Any, seed: int) -> None:
    want = _gpu_trainer.expected(seed, DEVICE, EXTRA)
    got = dict(result.tensors)
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name].view(torch.uint8).view(-1), tensor), name


def test_bytes_identical_and_cycle_two_opens_and_registers_nothing(trainer, mx_catalog, mx_model_name):
    with Receiver(mx_catalog, mx_model_name, device=DEVICE) as rec:
        registrations = None
        for version in (1, 2, 3):
            if version > 1:
                trainer.do("drain", version - 1, "drained")
            published = trainer.do("publish", (version, 10 * version), "published")
            assert published["exported"]
            result = rec.refit(version)
            check(result, 10 * version)
            s = result.stats
            assert s.transport == "cuda_ipc", s
            assert s.bytes_pulled == s.bytes_needed
            assert s.descriptors == 2  # one copy per region: the buffer's views coalesce
            if version == 1:
                # One handle per allocation: the caching allocator may put both regions in one.
                assert s.handles_opened in (1, 2) and s.new_registrations == 1  # and the arena
                registrations = published["registrations"]
            else:
                assert s.handles_opened == 0 and s.new_registrations == 0
                assert published["registrations"] == registrations  # the trainer registered nothing
        assert "nixl=off" in repr(rec.transport)  # no NIXL agent was ever started


def test_reallocation_after_a_drain_exports_new_handles_the_reader_follows(trainer, mx_catalog, mx_model_name):
    with Receiver(mx_catalog, mx_model_name, device=DEVICE) as rec:
        first = trainer.do("publish", (1, 5), "published")
        check(rec.refit(1), 5)
        trainer.do("drain", 1, "drained")
        moved = trainer.do("reallocate", 64 << 20, "reallocated")
        assert moved["released"] == 2
        second = trainer.do("publish", (2, 6), "published")
        assert second["registrations"] == first["registrations"] + 2
        result = rec.refit(2)
        check(result, 6)
        before, after = set(first["handles"]), set(second["handles"])
        assert before and after and not before & after  # freed and allocated afresh: new handles
        assert result.stats.transport == "cuda_ipc"
        assert result.stats.handles_opened == len(after)
        cache = rec.transport.ipc()._cache
        assert cache is not None and cache.closed == len(before)  # the old allocations' mappings are gone
        assert len(cache) == len(after)
        trainer.do("drain", 2, "drained")
        trainer.do("publish", (3, 7), "published")
        again = rec.refit(3)
        check(again, 7)
        assert again.stats.handles_opened == 0


def test_a_dead_source_is_named_and_the_engine_keeps_its_weights(trainer, mx_catalog, mx_model_name):
    engine: dict[str, Any] = {}  # what the engine holds: copies of the last good refit
    with Receiver(mx_catalog, mx_model_name, device=DEVICE) as rec:
        trainer.do("publish", (1, 21), "published")
        result = rec.refit(1)
        engine.update({n: t.clone() for n, t in result.tensors})
        trainer.do("drain", 1, "drained")
        trainer.do("publish", (2, 22), "published")
        trainer.proc.kill()
        trainer.proc.join(10)
        with pytest.raises(TransferError, match=rf"source {mx_model_name}/tp0-pp0-ep0: its process .* is gone") as err:
            rec.refit(2)
        assert err.value.source_id == f"{mx_model_name}/tp0-pp0-ep0"
        want = _gpu_trainer.expected(21, DEVICE, EXTRA)
        for name, tensor in engine.items():
            assert torch.equal(tensor.view(torch.uint8).view(-1), want[name]), name
        assert rec.transport.ipc().sources() == set()  # the dead source's handles are closed
        leases = [v.leases for v in rec.client.list_versions(model=mx_model_name)]
        assert sum(leases) == 0


def test_receiver_closing_mid_cycle(mx_catalog, mx_model_name):
    trainer = Trainer(mx_catalog, mx_model_name, extra_bytes=1 << 30)  # copies that take a while
    try:
        rec = Receiver(mx_catalog, mx_model_name, device=DEVICE)
        trainer.do("publish", (1, 31), "published")
        outcomes: list[Any] = []

        def cycles() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    outcomes.append(rec.refit(1).stats.transport)
                except TransferError as exc:
                    outcomes.append(exc)
                    return

        worker = threading.Thread(target=cycles)
        worker.start()
        time.sleep(0.05)
        rec.close()
        worker.join(120)
        assert not worker.is_alive()
        assert isinstance(outcomes[-1], TransferError) and "closed" in str(outcomes[-1])
        assert all(o == "cuda_ipc" for o in outcomes[:-1])
        assert rec.transport.ipc().sources() == set()  # handles closed
        deadline = time.monotonic() + 10
        while sum(v.leases for v in rec.client.list_versions(model=mx_model_name)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sum(v.leases for v in rec.client.list_versions(model=mx_model_name)) == 0
        with pytest.raises(TransferError, match="closed"):
            rec.refit(1)
    finally:
        trainer.close()


def test_checksums_taken_in_vram_catch_a_flipped_bit_over_cuda_ipc(mx_catalog, mx_model_name):
    """Checksums computed on the trainer's GPU, verified on the receiver's: a bit flipped in the
    trainer's VRAM after publishing is caught, nothing is loaded; restored, the refit verifies."""
    trainer = Trainer(mx_catalog, mx_model_name, checksums=True)
    try:
        with Receiver(mx_catalog, mx_model_name, device=DEVICE, checksums=True) as rec:
            trainer.do("publish", (1, 31), "published")
            first = rec.refit(1)
            check(first, 31)
            assert first.stats.transport == "cuda_ipc" and first.stats.blocks_verified > 0
            fused = rec._cycle._copy_sums  # the copy itself summed every block (each byte read once)
            assert fused is not None and fused.launches == 1 and bool(fused.covered.all())
            name = trainer.do("flip", (3, 12345, 6), "flipped")
            with pytest.raises(ChecksumMismatch, match=f"tensor {name!r}"):
                rec.refit(1)
            trainer.do("flip", (3, 12345, 6), "flipped")
            again = rec.refit(1)
            check(again, 31)
            assert again.stats.blocks_verified == first.stats.blocks_verified
    finally:
        trainer.close()
