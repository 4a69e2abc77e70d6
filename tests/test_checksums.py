"""End-to-end checksums (weight_sync.checksums): the function, the widened reads, the catalog's
validation, and injected bit flips caught across processes over real NIXL and a real catalog."""

from __future__ import annotations

import bisect
import dataclasses
import multiprocessing as mp
import random
import uuid
from collections import defaultdict

import numpy as np
import pytest
import torch

from mx_refit import hookimpl
from mx_refit.catalog.service import CatalogService
from mx_refit.checksums import source_checksums, span_sums, verify, widen
from mx_refit.config import load_config
from mx_refit.errors import ChecksumMismatch, InvalidArgument, TransferError
from mx_refit.layout.planner import plan_receive
from mx_refit.plugins import Hooks
from mx_refit.publisher import Publisher
from mx_refit.ranges import coalesce
from mx_refit.receive.receiver import Receiver
from mx_refit.types import BlockChecksums, TargetLayout
from tests import _checksum_source
from tests.layout import _planner_harness
from tests.layout._planner_harness import ModelSpec, SourceLayout, expected_window, publish

pytestmark = pytest.mark.timeout(300)

BLOCK = 4096


@pytest.fixture(autouse=True)
def _reference_math(monkeypatch):
    # Megatron globals from the reference math, not Bridge (its import alone takes ~20 s): the
    # planner suite checks Bridge fidelity; these tests check what reaches the engine.
    monkeypatch.setattr(_planner_harness, "_PM", False)
# Big enough that tensors span many blocks (a row-sliced read touches blocks in part).
SPEC = dict(layers=1, hidden=256, heads=4, groups=2, head_dim=64, ffn=512, vocab=500)


def reference(data: bytes, block: int) -> list[int]:
    """The checksum as documented, in numpy's unsigned arithmetic (independent of torch)."""
    out = []
    for start in range(0, len(data), block):
        chunk = data[start : start + block]
        m = len(chunk) // 8
        words = np.frombuffer(chunk[: m * 8], dtype="<u8")
        weights = np.arange(m, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        total = int((words * weights).sum(dtype=np.uint64)) if m else 0
        total += sum(int(b) * (2 * (m + j) + 1) for j, b in enumerate(chunk[m * 8 :]))
        total %= 1 << 64
        out.append(total - (1 << 64) if total >= 1 << 63 else total)
    return out


def test_the_checksum_matches_an_independent_reference_at_any_size_and_alignment():
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (5 * BLOCK + 77,), dtype=torch.uint8, generator=g)
    for start, stop in ((0, 1), (0, 7), (0, BLOCK), (0, 3 * BLOCK + 5), (3, 3 + 2 * BLOCK + 9), (5, 5 * BLOCK + 77)):
        span = data[start:stop]  # starts 3 and 5 are not 8-aligned: copied on the device first
        assert span_sums(span, BLOCK).tolist() == reference(span.numpy().tobytes(), BLOCK), (start, stop)
    bf16 = torch.randn(3001, generator=g).to(torch.bfloat16)  # 6002 bytes: a whole block and a tail
    sums = source_checksums([bf16, torch.empty(0), bf16[1:]], BLOCK)
    assert sums.sums == tuple(reference(bf16.view(torch.uint8).numpy().tobytes(), BLOCK)
                              + reference(bf16[1:].view(torch.uint8).numpy().tobytes(), BLOCK))


def test_every_single_bit_flip_of_a_block_changes_its_checksum():
    g = torch.Generator().manual_seed(2)
    block = torch.randint(0, 256, (1003,), dtype=torch.uint8, generator=g)  # 125 words + 3 tail bytes
    clean = int(span_sums(block, BLOCK)[0])
    missed = []
    for byte in range(block.numel()):
        for bit in range(8):
            block[byte] ^= 1 << bit
            if int(span_sums(block, BLOCK)[0]) == clean:
                missed.append((byte, bit))
            block[byte] ^= 1 << bit
    assert not missed and int(span_sums(block, BLOCK)[0]) == clean


# --- widened reads over the planner's layouts (byte copies standing in for the pull) ----------


def _sources_with_checksums(published):
    sources = {}
    for source in published.version.sources:
        base, blob = published.memory[source.source_id]
        views = [blob[d.addr - base : d.addr - base + d.nbytes] for d in source.tensors]
        sources[source.source_id] = dataclasses.replace(source, checksums=source_checksums(views, BLOCK))
    return sources


def _execute(requests, arena_bytes, memory):
    arena = torch.full((arena_bytes,), 0xA5, dtype=torch.uint8)
    for sid, ops in requests.items():
        base, blob = memory[sid]
        for remote, local, n in ops:
            arena[local : local + n] = blob[remote - base : remote - base + n]
    return arena


CASE_IDS = ["tp2-whole", "tp2-to-tp1", "tp2-to-tp4r1", "tp1-to-tp2r1", "tp1-to-tp4r2"]
CASES = [  # (source TP, target): TP2 -> TP1 and TP1 -> TP2/TP4, sliced (row and column windows) and whole
    (2, TargetLayout(full_tensors=True)),
    (2, TargetLayout(tp_rank=0, tp_size=1, full_tensors=False)),
    (2, TargetLayout(tp_rank=1, tp_size=4, full_tensors=False)),
    (1, TargetLayout(tp_rank=1, tp_size=2, full_tensors=False)),
    (1, TargetLayout(tp_rank=2, tp_size=4, full_tensors=False)),
]


@pytest.mark.parametrize(("tp", "target"), CASES, ids=CASE_IDS)
def test_every_planned_byte_lies_in_a_verified_block(tp, target):
    spec = ModelSpec("cover", **SPEC)
    published = publish(spec, SourceLayout(tp=tp))
    sources = _sources_with_checksums(published)
    version = dataclasses.replace(published.version, sources=tuple(sources.values()))
    plan = plan_receive(version, target)
    grouped = defaultdict(list)
    for op in plan.reads:
        grouped[op.source_id].append((op.remote_addr, op.local_offset, op.nbytes))
    widening = widen({s: coalesce(o) for s, o in grouped.items()}, sources, plan.arena_bytes)

    # Provenance: an arena byte is trusted once a verified run covers it or a copy moved
    # trusted bytes onto it; every byte the plan places must end up trusted.
    trusted = torch.zeros(widening.arena_bytes, dtype=torch.bool)
    for run in widening.runs:
        trusted[run.arena_offset : run.arena_offset + run.nbytes] = True
    for staged, place, n in widening.copies:
        assert bool(trusted[staged : staged + n].all())
        trusted[place : place + n] = True
    for op in plan.reads:
        assert bool(trusted[op.local_offset : op.local_offset + op.nbytes].all()), op
    assert not (tp == 2 and target.tp_size == 4) or widening.staged_bytes > 0  # partial blocks exist

    arena = _execute(widening.requests, widening.arena_bytes, published.memory)
    assert verify(arena, widening, sources) == sum(-(-r.nbytes // BLOCK) for r in widening.runs)
    got = dict(plan.materialize(arena[: plan.arena_bytes]))
    for name, full in published.hf.items():
        want = expected_window(name, full, spec, target)
        assert torch.equal(got[name].contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), name

    # A flip inside any pulled block is caught; one outside every pulled block changes nothing.
    pulled = {(sid, remote, n) for sid, ops in widening.requests.items() for remote, _, n in ops}
    rng = random.Random(3)
    caught = clean = 0
    for _ in range(40):
        sid = rng.choice(sorted(published.memory))
        base, blob = published.memory[sid]
        offset, bit = rng.randrange(blob.numel()), rng.randrange(8)
        hit = any(s == sid and r <= base + offset < r + n for s, r, n in pulled)
        blob[offset] ^= 1 << bit
        arena = _execute(widening.requests, widening.arena_bytes, published.memory)
        blob[offset] ^= 1 << bit
        if hit:
            with pytest.raises(ChecksumMismatch, match=f"from source {sid!r}"):
                verify(arena, widening, sources)
            caught += 1
        else:
            verify(arena, widening, sources)
            clean += 1
    assert caught + clean == 40 and caught > 0


def test_a_source_without_checksums_is_refused_by_a_verifying_receiver():
    published = publish(ModelSpec("nosums", **SPEC), SourceLayout(tp=1))
    sources = {s.source_id: s for s in published.version.sources}
    plan = plan_receive(published.version, TargetLayout())
    grouped = defaultdict(list)
    for op in plan.reads:
        grouped[op.source_id].append((op.remote_addr, op.local_offset, op.nbytes))
    with pytest.raises(TransferError, match="published no checksums") as info:
        widen(dict(grouped), sources, plan.arena_bytes)
    assert info.value.source_id == "pp0-ep0-tp0"


def test_the_catalog_validates_checksums_and_the_config_its_keys():
    published = publish(ModelSpec("valid", **SPEC), SourceLayout(tp=1))
    source = _sources_with_checksums(published)["pp0-ep0-tp0"]
    service = CatalogService()
    bad = {
        "source.checksums.sums: 3 values": BlockChecksums(BLOCK, (1, 2, 3)),
        "source.checksums.block_bytes: must be a multiple of 8": BlockChecksums(1000, source.checksums.sums),
        r"source.checksums.sums\[0\]: 18446744073709551615 is not an int64": BlockChecksums(
            BLOCK, (2**64 - 1,) + source.checksums.sums[1:]),
    }
    for message, checksums in bad.items():
        with pytest.raises(InvalidArgument, match=message):
            service.register_source("valid", 1, 1, dataclasses.replace(source, checksums=checksums))
    assert service.list_versions("valid") == []  # nothing was registered
    service.register_source("valid", 1, 1, source)
    assert service.get_version("valid", 1).sources[0].checksums == source.checksums
    with pytest.raises(InvalidArgument, match="weight_sync.checksums: 'yes'"):
        load_config({"checksums": "yes"})
    with pytest.raises(InvalidArgument, match="weight_sync.checksum_block_bytes: must be a multiple of 8"):
        load_config({"checksums": True, "checksum_block_bytes": 100})
    assert load_config({}).checksums is False  # off by default


def test_off_by_default_publishes_no_checksums_and_verifies_nothing(mx_catalog, mx_model_name, monkeypatch):
    import mx_refit.checksums as checksums

    def never(*args, **kwargs):
        raise AssertionError("a checksum was computed with checksums off")

    for name in ("source_checksums", "span_sums", "widen", "verify"):
        monkeypatch.setattr(checksums, name, never)
    weights = {"w": torch.randn(300, 70), "b": torch.randn(33).to(torch.bfloat16)}
    with Publisher(mx_catalog, mx_model_name) as pub, Receiver(mx_catalog, mx_model_name) as rec:
        pub.publish(1, model=weights)
        assert rec.client.get_version(model=mx_model_name, version=1).sources[0].checksums is None
        result = rec.refit(1)
        assert result.stats.blocks_verified == 0 and "verify" in result.stats.phase_seconds
        assert result.stats.bytes_pulled == result.stats.bytes_needed
        assert all(torch.equal(dict(result.tensors)[n], t) for n, t in weights.items())


def test_new_checksums_arrive_when_the_catalog_leaves_an_unchanged_layout_out(mx_catalog, mx_model_name):
    """The sums change every version while the layout does not: they travel with every reply
    (a verifying reader of version 2 would otherwise check version 1's sums and fail)."""
    weights = {"w": torch.randn(3000, 7), "b": torch.randn(5).to(torch.bfloat16)}
    with Publisher(mx_catalog, mx_model_name, checksums=True, checksum_block_bytes=BLOCK) as pub, \
            Receiver(mx_catalog, mx_model_name, checksums=True) as rec:
        pub.publish(1, model=weights)
        assert rec.refit(1).stats.blocks_verified == 22  # 84,000 bytes in 21 blocks, and 1
        pub.wait_drained(1)
        weights["w"].mul_(-1)  # the optimizer step: same buffers, new bytes
        pub.publish(2, model=weights)
        omitted = rec.client.manifest_stats.sources_omitted
        result = rec.refit(2)
        assert rec.client.manifest_stats.sources_omitted == omitted + 1  # the layout was left out
        assert result.stats.blocks_verified == 22
        assert torch.equal(dict(result.tensors)["w"], weights["w"])


def test_a_failed_verification_is_not_a_completed_read_and_the_version_can_be_read_again(mx_catalog, mx_model_name):
    """Verification runs under the lease: a mismatch releases without completing the read, so a
    publisher waiting for its readers keeps waiting, and the same version is read again once
    its bytes are right."""
    weights = {"w": torch.randn(3000, 7)}
    with Publisher(mx_catalog, mx_model_name, checksums=True, checksum_block_bytes=BLOCK, expected_readers=1) as pub, \
            Receiver(mx_catalog, mx_model_name, checksums=True) as rec:
        pub.publish(1, model=weights)
        raw = weights["w"].view(-1).view(torch.uint8)
        raw[5000] ^= 0x10  # after the sums were taken: the bytes the reader pulls are wrong
        with pytest.raises(ChecksumMismatch, match="tensor 'w'"):
            rec.refit(1)
        (summary,) = [v for v in rec.client.list_versions(mx_model_name) if v.version == 1]
        assert summary.completed_reads == 0 and summary.expected_readers == 1
        raw[5000] ^= 0x10
        assert torch.equal(dict(rec.refit(1).tensors)["w"], weights["w"])
        pub.wait_read(1, timeout_s=30)  # the one completed read is the verified one


# --- across processes: the sources' memory is flipped, the receiver must catch it -------------


class _Failures:
    def __init__(self) -> None:
        self.seen: list[tuple[str, int | None, BaseException]] = []

    @hookimpl
    def mx_refit_refit_failed(self, model, version, error):
        self.seen.append((model, version, error))


class _SourceProcess:
    """One process publishing version 1 of a TP1 and a TP2 model (checksums on)."""

    def __init__(self, address: str, models: dict[str, int]) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_checksum_source.run, args=(address, models, SPEC, BLOCK, child), daemon=True)
        self.proc.start()
        self.ask(None, "ready")
        self.models = {model: _Sources(self, model) for model in models}

    def ask(self, message, reply, timeout=180):
        if message is not None:
            self.conn.send(message)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"no {reply!r} from the source process")
        kind, payload = self.conn.recv()
        if kind == "error":
            raise RuntimeError(payload)
        assert kind == reply, (kind, payload)
        return payload

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("stop", None))
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


class _Sources:
    """One model's sources in the source process."""

    def __init__(self, process: _SourceProcess, model: str) -> None:
        self.process, self.model = process, model
        self.layout, self.hf = self.ask("layout", None, "layout")
        self.index = {sid: sorted(views, key=lambda v: v[1]) for sid, views in self.layout.items()}
        self.ask("publish", 1, "published")

    def ask(self, cmd, arg, reply):
        return self.process.ask((cmd, (self.model, arg)), reply)

    def tensor_at(self, sid: str, offset: int):
        """(name, block) of the published tensor holding blob byte ``offset``, or None (a gap)."""
        views = self.index[sid]
        i = bisect.bisect_right([v[1] for v in views], offset) - 1
        if i >= 0 and views[i][1] <= offset < views[i][1] + views[i][2]:
            return views[i][0], (offset - views[i][1]) // BLOCK
        return None

    def pulled_blocks(self, plan) -> set[tuple[str, str, int]]:
        """(source, tensor, block) of every block a plan's reads touch, from the plan alone."""
        out = set()
        for op in plan.reads:
            for name, offset, nbytes, addr in self.layout[op.source_id]:
                lo, hi = max(op.remote_addr, addr), min(op.remote_addr + op.nbytes, addr + nbytes)
                out.update((op.source_id, name, b) for b in range((lo - addr) // BLOCK, (hi - 1 - addr) // BLOCK + 1)
                           if lo < hi)
        return out

@pytest.fixture(scope="module")
def source_process(mx_catalog):
    prefix = f"checksums-{uuid.uuid4().hex[:8]}"
    process = _SourceProcess(mx_catalog, {f"{prefix}-tp1": 1, f"{prefix}-tp2": 2})
    process.by_tp = {1: process.models[f"{prefix}-tp1"], 2: process.models[f"{prefix}-tp2"]}
    yield process
    process.close()


def _receiver(address, model, target, failures):
    hooks = Hooks()
    hooks.register(failures)
    engine: dict[str, torch.Tensor] = {}
    return Receiver(address, model, target=target, engine=engine, hooks=hooks, checksums=True), engine


def _expected(sources, target):
    spec = ModelSpec("x", **SPEC)
    return {n: w for n, full in sources.hf.items() if (w := expected_window(n, full, spec, target)) is not None}


def _same(engine, expected):
    return set(engine) == set(expected) and all(
        torch.equal(engine[n].contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)) for n, w in expected.items()
    )


@pytest.mark.slow
def test_100_of_100_bit_flips_in_the_sources_memory_are_caught(mx_catalog, source_process):
    """TP1 source, whole-tensor receiver: every published byte is pulled, so every flip of a
    random bit of a random published tensor must be caught, naming tensor and source; nothing
    is loaded, the engine keeps the previous weights, mx_refit_refit_failed fires."""
    sources = source_process.by_tp[1]
    failures = _Failures()
    target = TargetLayout(full_tensors=True)
    rec, engine = _receiver(mx_catalog, sources.model, target, failures)
    try:
        first = rec.refit(1)
        expected = _expected(sources, target)
        assert _same(engine, expected) and first.stats.blocks_verified > 0
        rng = random.Random(13)
        caught = 0
        for i in range(100):
            sid = rng.choice(sorted(sources.layout))
            name, offset, nbytes, _ = rng.choice(sources.layout[sid])
            where, bit = offset + rng.randrange(nbytes), rng.randrange(8)
            sources.ask("flip", (sid, where, bit), "flipped")
            with pytest.raises(ChecksumMismatch) as info:
                rec.refit(1)
            sources.ask("flip", (sid, where, bit), "flipped")  # restore
            err = info.value
            assert (err.source_id, err.tensor) == (sid, name), (err, sid, name)
            assert err.block == (where - offset) // BLOCK and "nothing was loaded" in str(err)
            assert failures.seen[-1][2] is err and len(failures.seen) == i + 1
            assert _same(engine, expected)  # the previous weights, untouched
            caught += 1
            if i % 25 == 24:  # restored bytes verify again
                assert rec.refit(1).stats.blocks_verified == first.stats.blocks_verified
        assert caught == 100
    finally:
        rec.close()


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "target"), [
    (2, TargetLayout(tp_rank=0, tp_size=1, full_tensors=False)),
    (2, TargetLayout(tp_rank=1, tp_size=4, full_tensors=False)),
    (1, TargetLayout(tp_rank=1, tp_size=2, full_tensors=False)),
], ids=["tp2-to-tp1", "tp2-to-tp4r1", "tp1-to-tp2r1"])
def test_resharding_receivers_catch_flips_in_what_they_pull_and_ignore_the_rest(mx_catalog, source_process, tp, target):
    """Real NIXL, real Megatron planner: a flip in a block the receiver pulls fails the refit
    (with nothing loaded); a flip anywhere else leaves a byte-exact refit."""
    sources = source_process.by_tp[tp]
    failures = _Failures()
    rec, engine = _receiver(mx_catalog, sources.model, target, failures)
    try:
        first = rec.refit(1)
        expected = _expected(sources, target)
        assert _same(engine, expected)
        pulled = sources.pulled_blocks(first.plan)
        rng = random.Random(tp * 10 + target.tp_size)
        counts = {"caught": 0, "needed_caught": 0, "ignored": 0}
        for _ in range(30):
            sid = rng.choice(sorted(sources.layout))
            name, offset, nbytes, _ = rng.choice(sources.layout[sid])
            where, bit = offset + rng.randrange(nbytes), rng.randrange(8)
            hit = (sid, name, (where - offset) // BLOCK) in pulled
            sources.ask("flip", (sid, where, bit), "flipped")
            try:
                if hit:
                    with pytest.raises(ChecksumMismatch, match=f"tensor {name!r} from source {sid!r}"):
                        rec.refit(1)
                    counts["caught"] += 1
                else:
                    rec.refit(1)
                    counts["ignored"] += 1
                assert _same(engine, expected)  # either the untouched previous weights or a byte-exact refit
            finally:
                sources.ask("flip", (sid, where, bit), "flipped")
        assert counts["caught"] > 0 and counts["caught"] + counts["ignored"] == 30
        assert len(failures.seen) == counts["caught"]
        assert first.stats.bytes_pulled >= first.stats.bytes_needed
    finally:
        rec.close()
