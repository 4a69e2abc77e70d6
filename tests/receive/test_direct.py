"""receive_mode direct: the bytes go into the engine's parameters through a bounded buffer, chunk
by chunk (two trainer processes publishing over real NIXL, a real catalog over gRPC)."""

from __future__ import annotations

import pytest
import torch

from mx_refit.config import load_config
from mx_refit.errors import FailedPrecondition, InvalidArgument, NotFound, PartiallyUpdated
from mx_refit.hookspecs import hookimpl
from mx_refit.plan import PlannedOutput
from mx_refit.receive.direct import chunk_outputs
from mx_refit.receive.receiver import Receiver
from tests import _trainer_proc
from tests.receive.test_refit import Trainers

pytestmark = pytest.mark.timeout(180)

BUFFER = 4096  # the smallest accepted: the 8 KiB embedding and the staged 3 KiB projection are split


@pytest.fixture
def trainers():
    from mx_refit.catalog.server import start_embedded

    server = start_embedded()
    t = Trainers(server.address, "direct-model", 2)
    t.address = server.address
    t.all("publish", (1, 101), "published")
    yield t
    t.close()
    server.stop(0)


def _zeros() -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(t) for n, t in _trainer_proc.full_tensors(0).items()}


def allocation_peak(fn):
    """``(fn(), the peak of torch's CPU allocations while it ran, in bytes)``: torch's profiler
    records every allocation and free of the process in order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    current = peak = 0
    for event in prof.profiler.kineto_results.events():
        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU:
            current += event.nbytes()
            peak = max(peak, current)
    return result, peak


def test_direct_refit_is_byte_identical_through_a_small_buffer(trainers):
    engine = _zeros()
    model_bytes = sum(t.numel() * t.element_size() for t in engine.values())
    with Receiver(trainers.address, "direct-model", engine=engine, receive_mode="direct",
                  receive_buffer_bytes=BUFFER) as rec:
        result, peak = allocation_peak(lambda: rec.refit(1))
        expected = _trainer_proc.full_tensors(101)
        for name, tensor in expected.items():
            assert torch.equal(engine[name], tensor), name
        stats = result.stats
        assert stats.receive_mode == "direct" and stats.chunks >= 4  # 12.2 KiB through 4 KiB
        assert stats.receive_memory_bytes <= BUFFER and result.tensors == []
        assert rec._arena is None
        # Everything torch allocated during the refit (the buffer included) is within the setting.
        assert 0 < peak <= BUFFER, peak
        buffer = rec._cycle.buffer
        assert buffer is not None and buffer.numel() <= BUFFER
        assert stats.bytes_pulled == stats.bytes_needed == model_bytes

        # The same model staged, for contrast: its arena is the whole version.
        with Receiver(trainers.address, "direct-model", engine=_zeros()) as staged:
            staged_result, staged_peak = allocation_peak(lambda: staged.refit(1))
        assert staged_result.stats.receive_mode == "staged"
        assert staged_peak >= model_bytes > BUFFER

        # Next version: the buffer is reused, every byte still lands.
        trainers.all("publish", (2, 202), "published")
        again = rec.refit(2)
        assert rec._cycle.buffer is buffer and again.stats.new_registrations == 0
        for name, tensor in _trainer_proc.full_tensors(202).items():
            assert torch.equal(engine[name], tensor), name


def test_tensors_the_engine_takes_only_whole_must_fit_before_any_byte(trainers):
    failed: list[int | None] = []
    engine: dict[str, torch.Tensor] = {}  # no destinations: no row writers, everything whole
    with Receiver(trainers.address, "direct-model", engine=engine, receive_mode="direct",
                  receive_buffer_bytes=BUFFER) as rec:
        rec.hooks.register(_Failed(failed))
        with pytest.raises(FailedPrecondition, match=r"tensor 'embed.weight' \(8192 bytes\) does not fit the "
                           r"4096-byte receive buffer .*receive_buffer_bytes >= 8208"):
            rec.refit(1)
        assert engine == {} and rec._cycle.buffer is None  # refused before anything was allocated or written
        with pytest.raises(NotFound):
            rec.refit(7)
        assert failed == [1, 7]
    with Receiver(trainers.address, "direct-model", engine=engine, receive_mode="direct",
                  receive_buffer_bytes=1 << 20) as rec:
        rec.refit(1)  # a buffer that holds each tensor: loaded whole through load_weights
        for name, tensor in _trainer_proc.full_tensors(101).items():
            assert torch.equal(engine[name], tensor), name


def test_a_failure_after_the_first_write_says_the_parameters_are_partial(trainers):
    engine = _zeros()
    engine["norm.weight"] = torch.zeros(31)  # the engine refuses this tensor at load time
    failed: list[int | None] = []
    with Receiver(trainers.address, "direct-model", engine=engine, receive_mode="direct",
                  receive_buffer_bytes=BUFFER) as rec:
        rec.hooks.register(_Failed(failed))
        with pytest.raises(PartiallyUpdated, match=r"refit of model 'direct-model' version 1 failed after \d+ of "
                           r"\d+ chunks were written .*part of version 1 and part of the previous weights; do not "
                           r"serve them, refit again") as caught:
            rec.refit(1)
        assert caught.value.version == 1 and caught.value.model == "direct-model"
        assert failed == [1]
        assert any(not torch.equal(t, torch.zeros_like(t)) for t in engine.values())  # bytes did land


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"receive_buffer_bytes": 0}, r"receive_buffer_bytes: must be an integer >= 4096, got 0"),
        ({"receive_buffer_bytes": -1}, r"receive_buffer_bytes: must be an integer >= 4096, got -1"),
        ({"receive_buffer_bytes": 4095}, r"receive_buffer_bytes: must be an integer >= 4096, got 4095"),
        ({"receive_buffer_bytes": "64M"}, r"receive_buffer_bytes: must be an integer >= 4096, got '64M'"),
        ({"receive_buffer_bytes": True}, r"receive_buffer_bytes: must be an integer >= 4096, got True"),
        ({"receive_buffer_bytes": 65536.0}, r"receive_buffer_bytes: must be an integer >= 4096, got 65536.0"),
        ({"receive_mode": "drect"}, r"receive_mode: 'drect' \(expected 'staged' or 'direct'\)"),
        ({"receive_mode": "direct", "fanout": "tree"}, r"fanout: 'tree' offers the receive arena as a replica; "
         r"receive_mode 'direct' keeps no arena"),
        ({"receive_mode": "direct", "checksums": True}, r"checksums: True verifies the whole version"),
        ({"receive_mode": "direct", "delta": "auto"}, r"delta: 'auto' applies a delta"),
    ],
)
def test_bad_settings_are_refused_naming_field_and_value(kwargs, message):
    with pytest.raises(InvalidArgument, match=message):
        Receiver("127.0.0.1:1", "m", engine={}, **kwargs)


@pytest.mark.parametrize(
    "block, message",
    [
        ({"receive_buffer_bytes": 0}, r"weight_sync.receive_buffer_bytes: 0 \(expected an integer >= 4096\)"),
        ({"receive_buffer_bytes": "1GiB"}, r"weight_sync.receive_buffer_bytes: '1GiB' \(expected an integer"),
        ({"receive_mode": "inplace"}, r"weight_sync.receive_mode: 'inplace' \(expected 'staged' or 'direct'\)"),
    ],
)
def test_bad_config_is_refused_naming_field_and_value(block, message):
    with pytest.raises(InvalidArgument, match=message):
        load_config(block)


def test_from_config_carries_the_mode_and_the_buffer(trainers):
    cfg = load_config({"model_name": "direct-model", "receive_mode": "direct", "receive_buffer_bytes": 8192,
                       "catalog": {"mode": "standalone", "address": trainers.address}})
    engine = _zeros()
    with Receiver.from_config(cfg, engine=engine) as rec:
        assert (rec.receive_mode, rec.receive_buffer_bytes) == ("direct", 8192)
        with pytest.raises(FailedPrecondition, match=r"stage\(\) needs receive_mode 'staged'"):
            rec.stage(1)
        result = rec.refit(1)
        assert result.stats.receive_memory_bytes <= 8192
        for name, tensor in _trainer_proc.full_tensors(101).items():
            assert torch.equal(engine[name], tensor), name


def test_chunks_split_rows_with_their_staged_blocks_and_name_a_row_too_wide():
    wide = PlannedOutput("w", 0, 64 * 1024, (16, 2048), "float16", copies=((65536, 1024, 1024, 0),
                                                                           (65536 + 16384, 1024, 1024, 1024)))
    chunks = chunk_outputs([wide], 8192, {"w"})
    rows = [(p.first, p.rows) for c in chunks for p in c.pieces]
    assert rows[0] == (0, 1) and sum(n for _, n in rows) == 16  # 4 KiB + 2 x 1 KiB per row, 8 KiB buffer
    assert all(c.nbytes <= 8192 for c in chunks)
    spans = [(lo, hi) for c in chunks for lo, hi, _ in c.intervals]
    assert sum(hi - lo for lo, hi in spans) == 64 * 1024 + 2 * 16 * 1024  # every needed byte, once
    with pytest.raises(InvalidArgument, match=r"receive_buffer_bytes: 4096 cannot hold one row of tensor 'w' "
                       r"\(6192 bytes with its staged blocks\); use at least 6192"):
        chunk_outputs([wide], 4096, {"w"})


class _Failed:
    def __init__(self, seen: list[int | None]) -> None:
        self.seen = seen

    @hookimpl
    def mx_refit_refit_failed(self, model, version, error) -> None:
        self.seen.append(version)
