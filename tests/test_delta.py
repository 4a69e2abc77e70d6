"""Delta refits (weight_sync.delta): the records (every form, every width), the catalog carrying a
source's delta over real gRPC and refusing bad ones, and deltas mapped through the Megatron
receive planner onto resharded targets, bit for bit equal to a full pull of the same version."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest
import torch

from mx_refit.catalog.client import CatalogClient
from mx_refit.checksums import source_checksums
from mx_refit.delta import checksums_digest
from mx_refit.delta.batch import Item, apply_batch, direct_address
from mx_refit.delta.records import apply_changes, decode, encode
from mx_refit.errors import InvalidArgument
from mx_refit.layout.planner import plan_receive
from mx_refit.publisher import Publisher
from mx_refit.receive.receiver import Receiver
from mx_refit.types import DeltaForm, SourceDelta, TargetLayout, TensorDelta
from tests.layout import _planner_harness
from tests.layout._planner_harness import ModelSpec, SourceLayout, publish

pytestmark = pytest.mark.timeout(300)

BLOCK = 4096


@pytest.fixture(autouse=True)
def _reference_math(monkeypatch):
    monkeypatch.setattr(_planner_harness, "_PM", False)  # reference math, not Bridge (slow import)


def _nudge(t: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """A copy of ``t`` with about ``fraction`` of its elements moved by ~1% (an optimizer step
    that crosses rounding steps), in the tensor's own dtype."""
    gen = torch.Generator().manual_seed(seed)
    new = t.clone()
    mask = torch.rand(t.shape, generator=gen) < fraction
    step = 1.01 if t.element_size() > 1 else 1.25  # FP8 has 3 mantissa bits
    moved = (t.float() + 1).to(t.dtype) if not t.dtype.is_floating_point else (t.float() * step + 1e-3).to(t.dtype)
    new[mask] = moved[mask]
    return new


def _roundtrip(old: torch.Tensor, new: torch.Tensor, base: int = 4096) -> tuple[DeltaForm, int]:
    rec = encode(old, new)
    if rec is None:
        return None, 0
    arena = old.reshape(-1).view(torch.uint8).clone()
    nbytes = arena.numel()
    if rec.form is DeltaForm.WHOLE:
        arena.copy_(new.reshape(-1).view(torch.uint8))
    else:
        positions, values = decode(rec.form, rec.data, nbytes, old.element_size(), rec.changed, rec.narrow)
        apply_changes(arena, positions + base, values, [(base, 0, nbytes)])
    assert torch.equal(arena, new.reshape(-1).view(torch.uint8))
    return rec.form, rec.data.numel()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.float8_e4m3fn, torch.int8])
def test_records_reproduce_the_new_bytes_exactly_in_every_form(dtype):
    torch.manual_seed(0)
    old = (torch.randn(517, 33) * 3).to(dtype)
    assert encode(old, old.clone()) is None  # nothing changed: no record
    sparse = _nudge(old, 0.02, 1)
    form, size = _roundtrip(old, sparse)
    assert form is DeltaForm.SPARSE and size < 0.1 * old.numel() * old.element_size()
    dense = torch.where(torch.rand(old.shape) < 0.95, (old.float() * -1.5 + 0.5).to(dtype), old)
    assert _roundtrip(old, dense)[0] is DeltaForm.WHOLE
    clustered = old.clone()
    clustered[100:140] = (old[100:140].float() * -2 + 1).to(dtype)  # whole rows rewritten
    assert _roundtrip(old, clustered)[0] is DeltaForm.BLOCKS


def test_a_change_on_the_last_partial_block_and_the_first_element():
    old = torch.randn(1000).to(torch.bfloat16)  # 2000 bytes: the last 256-byte block is partial
    new = old.clone()
    new[0] = 7.0
    new[-100:] = -new[-100:]
    assert _roundtrip(old, new)[0] in (DeltaForm.SPARSE, DeltaForm.BLOCKS)
    sign = old.clone()
    sign[::300] = -sign[::300]  # the sign lives in the second byte: a wide entry
    rec = encode(old, sign)
    assert rec.form is DeltaForm.SPARSE and rec.narrow == 0 and rec.changed == 4
    _roundtrip(old, sign)


def test_the_batched_apply_equals_record_by_record_in_every_form_width_and_read_shape():
    """Tensors of every width in SPARSE (narrow and wide) and BLOCKS form, some held whole by one
    read and some in pieces (a window, a tail), applied at once: the bytes of decode+apply_changes."""
    torch.manual_seed(0)
    olds, news, los, at = [], [], [], 1000
    for i, dtype in enumerate([torch.bfloat16, torch.float32, torch.float16, torch.float8_e4m3fn] * 3):
        old = (torch.randn(301 + 7 * i, 33) * 3).to(dtype)
        new = _nudge(old, 0.02, i) if i % 3 != 2 else old.clone()
        if i % 3 == 2:
            new[50:90] = (old[50:90].float() * -2 + 1).to(dtype)  # only rows rewritten: BLOCKS
        if i % 4 == 0:
            new[::7, 0] = -new[::7, 0]  # sign flips: wide entries
        olds.append(old)
        news.append(new)
        los.append(at)
        at += old.numel() * old.element_size() + 64
    reads, local = [], 0
    for i, old in enumerate(olds):
        nbytes = old.numel() * old.element_size()
        if i % 4 == 1:  # held in two pieces, a gap between them
            reads += [(los[i] + nbytes // 3, local, nbytes // 3), (los[i] + nbytes // 3 * 2 + 5, local + nbytes // 3 + 16,
                                                                   nbytes - nbytes // 3 * 2 - 5)]
        else:
            reads.append((los[i], local, nbytes))
        local += nbytes + 32
    arena = torch.randint(0, 256, (local,), dtype=torch.uint8)
    want, got = arena.clone(), arena.clone()
    items, parts, offset, forms = [], [], 0, set()
    for i, (old, new) in enumerate(zip(olds, news)):
        rec = encode(old, new)
        nbytes = old.numel() * old.element_size()
        forms.add((rec.form, old.element_size(), rec.narrow < rec.changed))
        mine = [(max(r, los[i]), n0 + max(r, los[i]) - r, min(r + n, los[i] + nbytes) - max(r, los[i]))
                for r, n0, n in reads if r < los[i] + nbytes and los[i] < r + n]
        positions, values = decode(rec.form, rec.data, nbytes, old.element_size(), rec.changed, rec.narrow)
        apply_changes(want, positions + los[i], values, mine)
        items.append(Item(rec.form, offset, rec.data.numel(), los[i], nbytes, old.element_size(), rec.changed,
                          rec.narrow, direct_address(los[i], nbytes, mine)))
        parts.append(rec.data)
        offset += rec.data.numel()
    records = torch.cat(parts)
    assert apply_batch(got, records, items, reads) > 0
    assert torch.equal(got, want) and not torch.equal(got, arena)
    assert {f for f, _, _ in forms} == {DeltaForm.SPARSE, DeltaForm.BLOCKS}
    assert {(s, w) for f, s, w in forms if f is DeltaForm.SPARSE} >= {(2, True), (4, True), (1, False)}
    assert sum(it.direct is None for it in items) == 3
    bad = records.clone()
    first = next(it for it in items if it.form is DeltaForm.SPARSE)
    bad[first.offset] += 1  # a chunk count that no longer sums to the list's entries
    with pytest.raises(InvalidArgument, match="chunk counts"):
        apply_batch(arena.clone(), bad, items, reads)


def _delta_for(source, old_views, new_views, base_version, base_checksums):
    """A SourceDelta of ``new_views`` against ``old_views``, its records laid out at the end of
    the source's memory (as a publisher's record buffer)."""
    entries, parts, offset = [], [], 0
    for index, (old, new) in enumerate(zip(old_views, new_views)):
        rec = encode(old, new)
        if rec is None:
            continue
        size = rec.data.numel()
        entries.append(TensorDelta(index, rec.form, offset if size else 0, size, rec.changed, rec.narrow))
        parts.append(rec.data)
        offset += size
    records = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return entries, records


def test_the_catalog_carries_a_delta_over_grpc_and_refuses_bad_ones(mx_catalog, mx_model_name):
    published = publish(ModelSpec("grpc", layers=1), SourceLayout(tp=1))
    source = published.version.sources[0]
    base, blob = published.memory[source.source_id]
    views = [blob[d.addr - base : d.addr - base + d.nbytes] for d in source.tensors]
    memory = (base, blob.numel())
    region = (base + blob.numel() + 4096, 1 << 16)  # the record buffer
    delta = SourceDelta(
        base_version=1, base_digest=checksums_digest(source_checksums(views, BLOCK)), addr=region[0], nbytes=100,
        tensors=(TensorDelta(0, DeltaForm.WHOLE, 0, 0, 1), ), record_sums=(5,),
    )
    good = dataclasses.replace(
        source, checksums=source_checksums(views, BLOCK), regions=(memory, region), delta=delta,
    )
    client = CatalogClient(mx_catalog)
    try:
        bad = {
            "source.delta: a delta needs source.checksums": dataclasses.replace(good, checksums=None),
            r"source.delta.tensors\[0\].tensor: 99": dataclasses.replace(
                good, delta=dataclasses.replace(delta, tensors=(TensorDelta(99, DeltaForm.WHOLE, 0, 0, 1),))),
            r"source.delta.tensors\[0\]: a sparse record of 3 bytes": dataclasses.replace(
                good, delta=dataclasses.replace(delta, tensors=(TensorDelta(0, DeltaForm.SPARSE, 0, 3, 1, 1),))),
            "source.delta.record_sums: 0 values": dataclasses.replace(
                good, delta=dataclasses.replace(delta, record_sums=())),
            "source.delta: records .* lie outside every region": dataclasses.replace(good, regions=(memory,)),
        }
        for message, wrong in bad.items():
            with pytest.raises(InvalidArgument, match=message):
                client.register_source(mx_model_name, 2, 1, wrong)
        client.register_source(mx_model_name, 2, 1, good)
        got = client.get_version(mx_model_name, 2).sources[0]
        assert got.delta == delta
    finally:
        client.close()


CASES = [  # (spec, source TP, target): dense and MoE, resharded, sliced and whole
    (ModelSpec("dense", layers=2, hidden=256, heads=4, groups=2, head_dim=64, ffn=512, vocab=500), 2,
     TargetLayout(tp_rank=1, tp_size=4, full_tensors=False)),
    (ModelSpec("dense", layers=2, hidden=256, heads=4, groups=2, head_dim=64, ffn=512, vocab=500), 1,
     TargetLayout(tp_rank=1, tp_size=2, full_tensors=False)),
    (ModelSpec("dense", layers=1, hidden=128, heads=4, groups=2, head_dim=32, ffn=256, vocab=300), 2,
     TargetLayout(full_tensors=True)),
    (ModelSpec("moe", layers=2, hidden=128, heads=4, groups=2, head_dim=32, experts=8, moe_ffn=64, vocab=300), 1,
     TargetLayout(tp_rank=0, tp_size=2, full_tensors=False)),
]


@pytest.mark.parametrize(("spec", "tp", "target"), CASES, ids=["tp2-to-tp4r1", "tp1-to-tp2r1", "tp2-whole", "moe-tp1-to-tp2"])
def test_a_delta_through_the_layout_engine_equals_a_full_pull(spec, tp, target):
    published = publish(spec, SourceLayout(tp=tp))
    version = published.version
    plan = plan_receive(version, target)
    requests = defaultdict(list)
    for op in plan.reads:
        requests[op.source_id].append((op.remote_addr, op.local_offset, op.nbytes))

    def pull(memory):
        arena = torch.full((plan.arena_bytes,), 0xA5, dtype=torch.uint8)
        for sid, ops in requests.items():
            base, blob = memory[sid]
            for remote, local, n in ops:
                arena[local : local + n] = blob[remote - base : remote - base + n]
        return arena

    held = pull(published.memory)  # the receiver holds version 1
    batched = held.clone()  # the same, through the batched apply (all of a source's records at once)
    new_memory, untouched, read_tensors, pieces = {}, 0, 0, 0
    for source in version.sources:
        base, blob = published.memory[source.source_id]
        new_blob = blob.clone()
        for i, d in enumerate(source.tensors):
            view = new_blob[d.addr - base : d.addr - base + d.nbytes]
            if "experts" in d.name and i % 3:  # experts the router never picked: no gradient
                untouched += 1
                continue
            typed = view.view(getattr(torch, d.dtype))
            typed.copy_(_nudge(typed, 0.02 if i % 5 else 0.9, seed=i))  # some tensors dense
        new_memory[source.source_id] = (base, new_blob)
        old_views = [blob[d.addr - base : d.addr - base + d.nbytes].view(getattr(torch, d.dtype)) for d in source.tensors]
        new_views = [new_blob[d.addr - base : d.addr - base + d.nbytes].view(getattr(torch, d.dtype)) for d in source.tensors]
        entries, records = _delta_for(source, old_views, new_views, 1, None)
        items = []
        for entry in entries:  # the receiver's side: what its reads hold of each changed tensor
            d = source.tensors[entry.tensor]
            mine = [r for r in requests.get(source.source_id, ()) if r[0] < d.addr + d.nbytes and d.addr < r[0] + r[2]]
            if entry.form is DeltaForm.WHOLE:
                for remote, local, n in mine:
                    lo, hi = max(remote, d.addr), min(remote + n, d.addr + d.nbytes)
                    held[local + lo - remote : local + hi - remote] = new_blob[lo - base : hi - base]
                    batched[local + lo - remote : local + hi - remote] = new_blob[lo - base : hi - base]
                    read_tensors += 1
                continue
            data = records[entry.offset : entry.offset + entry.nbytes]
            itemsize = new_views[entry.tensor].element_size()
            positions, values = decode(entry.form, data, d.nbytes, itemsize, entry.changed, entry.narrow)
            apply_changes(held, positions + d.addr, values, mine)
            clipped = [(max(r, d.addr), n0 + max(r, d.addr) - r, min(r + n, d.addr + d.nbytes) - max(r, d.addr))
                       for r, n0, n in mine]
            direct = direct_address(d.addr, d.nbytes, clipped)
            pieces += direct is None
            items.append(Item(entry.form, entry.offset, entry.nbytes, d.addr, d.nbytes, itemsize, entry.changed,
                              entry.narrow, direct))
        if items:
            apply_batch(batched, records, items, sorted(requests[source.source_id]))
        assert len(entries) < len(source.tensors) or not untouched
    assert torch.equal(held, pull(new_memory))  # bit for bit what a full pull of version 2 holds
    assert torch.equal(batched, held)  # the batched apply writes exactly what record-by-record does
    assert pieces > 0 or target.full_tensors  # resharded targets hold tensors in pieces: the reads' path ran
    assert read_tensors > 0
    if spec.experts:
        assert untouched > 0


# --- end to end: a publisher and receivers over real NIXL and a real catalog ---------------------


def _step(weights: dict, version: int) -> None:
    """One optimizer step on the published buffers, in place: a sparse BF16 change, a dense
    one, and an expert the router never picked (untouched)."""
    weights["w"].copy_(_nudge(weights["w"], 0.02, seed=version))
    weights["b"].copy_(weights["b"] * -1)
    weights["e0"].copy_(_nudge(weights["e0"], 0.01, seed=100 + version))


def _same(result, weights) -> None:
    got = dict(result.tensors)
    for name, want in weights.items():
        assert torch.equal(got[name].view(torch.uint8), want.view(torch.uint8)), name


class _Engine:
    """A vLLM-style engine: ``load_weights`` copies, and records what it was handed."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.loaded: list[str] = []

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            self.loaded.append(name)
            self.weights[name] = tensor.clone()


def test_delta_refits_equal_full_pulls_and_anchor_every_n(mx_catalog, mx_model_name):
    weights = {
        "w": torch.randn(2048, 256).to(torch.bfloat16), "b": torch.randn(4096).to(torch.bfloat16),
        "e0": torch.randn(512, 128).to(torch.bfloat16), "e1": torch.randn(512, 128).to(torch.bfloat16),
    }
    with Publisher(mx_catalog, mx_model_name, delta="auto", delta_anchor_every=4, checksum_block_bytes=BLOCK) as pub, \
            Receiver(mx_catalog, mx_model_name, delta="on", engine=(engine := _Engine())) as rec, \
            Receiver(mx_catalog, mx_model_name, delta="on", delta_check_arena=False) as trusting, \
            Receiver(mx_catalog, mx_model_name, checksums=True) as full:
        pub.publish(1, model=weights)
        trusting.refit(1)
        first = rec.refit(1)
        assert first.stats.kind == "full" and first.stats.delta_refused == "no verified version held"
        _same(first, weights)
        full_bytes = full.refit(1).stats.bytes_pulled
        pub.wait_drained(1)
        for version in range(2, 7):
            _step(weights, version)
            pub.publish(version, model=weights)
            engine.loaded.clear()
            got, want, trusted = rec.refit(version), full.refit(version), trusting.refit(version)
            _same(got, weights)
            _same(want, weights)
            _same(trusted, weights)
            anchor = version == 5  # v1 whole, then 3 deltas, then an anchor
            assert trusted.stats.kind == got.stats.kind
            assert got.stats.kind == ("full" if anchor else "delta"), (version, got.stats.delta_refused)
            if not anchor:
                entries = rec.client.get_version(model=mx_model_name, version=version).sources[0].delta.tensors
                assert [e.tensor for e in entries] == [0, 1, 2]  # e1 (index 3) untouched: no entry, no read
                assert got.stats.bytes_pulled < 0.2 * full_bytes  # b whole (8 KiB + blocks) and records
                assert got.stats.bytes_changed > 0
                assert sorted(engine.loaded) == ["b", "e0", "w"]  # the untouched expert is not loaded again
            assert all(torch.equal(engine.weights[n].view(torch.uint8), w.view(torch.uint8)) for n, w in weights.items())
            pub.wait_drained(version)


def test_a_disturbed_arena_or_corrupt_records_fall_back_to_a_full_pull(mx_catalog, mx_model_name, caplog):
    weights = {"w": torch.randn(4096, 64).to(torch.bfloat16), "b": torch.randn(64).to(torch.bfloat16),
               "e0": torch.randn(64, 64).to(torch.bfloat16)}
    with Publisher(mx_catalog, mx_model_name, delta="auto", checksum_block_bytes=BLOCK) as pub, \
            Receiver(mx_catalog, mx_model_name, delta="on") as rec:
        pub.publish(1, model=weights)
        rec.refit(1)
        pub.wait_drained(1)
        _step(weights, 2)
        pub.publish(2, model=weights)
        rec._cycle.arena[10] ^= 0xFF  # the arena no longer holds what was verified
        got = rec.refit(2)
        assert got.stats.kind == "full" and got.stats.delta_refused == "the arena changed since it was verified"
        _same(got, weights)
        pub.wait_drained(2)
        _step(weights, 3)
        pub.publish(3, model=weights)
        pub._delta.records[3] ^= 0x01  # a bit flips in the publisher's record buffer
        with caplog.at_level("WARNING"):
            got = rec.refit(3)
        assert got.stats.kind == "full" and "the delta failed verification" in got.stats.delta_refused
        assert "pulling the version whole" in caplog.text
        _same(got, weights)
        pub.wait_drained(3)
        _step(weights, 4)
        pub.publish(4, model=weights)
        got = rec.refit(4)
        assert got.stats.kind == "delta"
        _same(got, weights)


def _start_source(address: str, model: str, spec_kwargs: dict, tp: int):
    import multiprocessing as mp

    from tests import _delta_source

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_delta_source.run, args=(address, model, spec_kwargs, tp, BLOCK, child), daemon=True)
    proc.start()
    return proc, conn


def _ask(conn, message, reply):
    if message is not None:
        conn.send(message)
    assert conn.poll(180), f"no {reply!r} from the source process"
    kind, payload = conn.recv()
    if kind == "error":
        raise RuntimeError(payload)
    assert kind == reply, (kind, payload)
    return payload


@pytest.mark.parametrize(("spec", "tp", "target"), [
    (dict(layers=2, hidden=256, heads=4, groups=2, head_dim=64, ffn=512, vocab=500), 2,
     TargetLayout(tp_rank=1, tp_size=4, full_tensors=False)),
    (dict(layers=2, hidden=128, heads=4, groups=2, head_dim=32, experts=8, moe_ffn=64, vocab=300), 1,
     TargetLayout(tp_rank=0, tp_size=2, full_tensors=False)),
], ids=["dense-tp2-to-tp4r1", "moe-tp1-to-tp2r0"])
def test_across_processes_a_resharding_delta_receiver_equals_a_full_one(mx_catalog, mx_model_name, spec, tp, target):
    """Trainer ranks in another process publish deltas; a resharding receiver that pulls deltas
    ends every version with exactly the bytes of one that pulls each version whole."""
    proc, conn = _start_source(mx_catalog, mx_model_name, spec, tp)
    try:
        _ask(conn, None, "ready")
        delta_engine: dict[str, torch.Tensor] = {}
        full_engine: dict[str, torch.Tensor] = {}
        with Receiver(mx_catalog, mx_model_name, target=target, engine=delta_engine, delta="on") as rec, \
                Receiver(mx_catalog, mx_model_name, target=target, engine=full_engine, checksums=True) as full:
            kinds = []
            for version in range(1, 5):
                _ask(conn, ("publish", version), "published")
                got, want = rec.refit(version), full.refit(version)
                kinds.append(got.stats.kind)
                assert set(delta_engine) == set(full_engine)
                for name, tensor in full_engine.items():
                    assert torch.equal(delta_engine[name].view(torch.uint8), tensor.view(torch.uint8)), (version, name)
                if version > 1:
                    assert got.stats.bytes_pulled < want.stats.bytes_pulled, (got.stats, want.stats)
            assert kinds == ["full", "delta", "delta", "delta"]
    finally:
        if proc.is_alive():
            conn.send(("stop", None))
        proc.join(10)
        if proc.is_alive():
            proc.kill()


@pytest.fixture
def _one_thread():
    """torch on one thread: this test weighs times, and two OpenMP threads on a host whose cores
    other work shares stall each other (small copies run 100x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_auto_pulls_the_delta_only_where_it_is_estimated_faster(mx_catalog, mx_model_name, _one_thread):
    """``delta: auto`` over real NIXL: a warm full pull is measured first, then a delta is tried
    (it measures a record byte's cost), then each version goes the way the estimates from the
    latest refits say: a change touching 8% of the elements (records of ~8% of the model, each
    entry to apply) is pulled whole, "a full pull is faster", and sparse ones are deltas. Every
    refit equals the published bytes."""
    weights = {f"w{i}": torch.randn(2048, 2048).to(torch.bfloat16) for i in range(8)}  # 64 MiB

    def sparse(version: int) -> None:
        for i, w in enumerate(weights.values()):
            w.view(-1)[version * 131 + i :: 20011] += 1  # ~0.005% of the elements

    def wide(version: int) -> None:
        for w in weights.values():
            w.copy_(_nudge(w, 0.08, seed=version))

    steps = [None, sparse, sparse, sparse, wide, wide, sparse, sparse]
    with Publisher(mx_catalog, mx_model_name, delta="auto", delta_anchor_every=100) as pub, \
            Receiver(mx_catalog, mx_model_name, delta="auto", delta_check_arena=False) as rec:
        stats = []
        for version, step in enumerate(steps, start=1):
            if step is not None:
                step(version)
            pub.publish(version, model=weights)
            got = rec.refit(version)
            _same(got, weights)
            stats.append(got.stats)
            pub.wait_drained(version)
    kinds = [s.kind for s in stats]
    summary = [(s.kind, s.full_estimate_s, s.delta_estimate_s, s.delta_refused[:40]) for s in stats]
    assert kinds[:3] == ["full", "full", "delta"], summary  # no base; a warm full measured; a delta tried
    assert stats[1].delta_refused.startswith("measuring a warm full pull first"), summary
    estimated = [s for s in stats if s.full_estimate_s]
    assert len(estimated) >= 3, summary
    for s in estimated:  # the cheaper estimate wins
        assert (s.kind == "delta") == (s.delta_estimate_s < s.full_estimate_s), summary
    faster = [s for s in stats[4:6] if s.kind == "full"]
    assert faster and faster[0].delta_refused.startswith("a full pull is faster on this transport"), summary
    assert kinds[6:] == ["delta", "delta"], summary
