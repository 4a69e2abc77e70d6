"""The failover planner (``mx_refit.receive.failover``): which live source holds a failed source's bytes,
how its reads are re-planned, and how an abort names what nobody holds. Pure Python, hand-built
manifests; the real-process cases are in ``tests/faults/test_failover_faults.py``."""

from __future__ import annotations

import pytest

from mx_refit.errors import TransferError
from mx_refit.plan import plan_full_tensors
from mx_refit.ranges import coalesce
from mx_refit.receive.failover import HolderIndex, describe_ranges, in_source_space, pull_with_failover, reroute
from mx_refit.transport.base import ReadReport
from mx_refit.types import (
    MeshPosition,
    Mirror,
    ReadOp,
    Role,
    SourceInfo,
    TensorDescriptor,
    VersionInfo,
    VersionState,
)


def desc(name: str, addr: int, nbytes: int = 1024, **kw) -> TensorDescriptor:
    shape = kw.pop("local_shape", (nbytes // 4,))
    return TensorDescriptor(name, "float32", kw.pop("global_shape", shape), shape, addr, nbytes, **kw)


def source(sid: str, rank: int, *tensors: TensorDescriptor) -> SourceInfo:
    return SourceInfo(sid, MeshPosition(tp_rank=rank, tp_size=3), f"agent-{sid}", b"meta", tuple(tensors), True)


def version(*sources: SourceInfo) -> VersionInfo:
    return VersionInfo("m", 7, VersionState.READY, len(sources), tuple(sources))


# "norm" is replicated on a, b and c (at different addresses), "emb" on a and b; "w" is column
# sharded over b and c (two shards: different bytes).
def shard(addr: int, offset: int) -> TensorDescriptor:
    return desc("w", addr, 512, role=Role.COLUMN, shard_axis=0, shard_offset=offset,
                global_shape=(256,), local_shape=(128,))


A = source("a", 0, desc("norm", 0x1000), desc("emb", 0x2000, 2048))
B = source("b", 1, desc("emb", 0x9000, 2048), desc("norm", 0x5000), shard(0x6000, 0))
C = source("c", 2, desc("norm", 0x7000), shard(0x8000, 128))


def test_a_range_maps_to_its_tensor_and_to_every_live_holder_of_the_same_bytes() -> None:
    index = HolderIndex(version(A, B, C))
    pieces = index.pieces("a", 0x1000 + 100, 1024 + 50)  # the tail of norm, then bytes of no tensor
    assert [(d.name if d else None, addr, n) for d, addr, n in pieces] == [
        ("norm", 0x1064, 924), (None, 0x1400, 150),
    ]
    norm = pieces[0][0]
    assert sorted(sid for sid, _ in index.holders(norm, exclude={"a"})) == ["b", "c"]
    assert [sid for sid, _ in index.holders(norm, exclude={"a", "b"})] == ["c"]
    first = next(d for d in B.tensors if d.name == "w")
    assert index.holders(first, exclude={"b"}) == []  # c's shard of w is other bytes


def test_rerouted_reads_land_at_the_same_arena_bytes_and_spread_over_the_survivors() -> None:
    index = HolderIndex(version(A, B, C))
    ops = [ReadOp("a", 0x1000, 512, 4096), ReadOp("a", 0x1000 + 512, 512, 8192)]
    load: dict[str, int] = {"b": 0, "c": 0}
    given, missing = reroute(index, version(A, B, C), ops, {"a"}, load)
    assert missing == []
    assert {(holder, op.source_id, op.remote_addr, op.nbytes, op.local_offset) for holder, op in given} == {
        ("b", "b", 0x5000, 512, 4096), ("c", "c", 0x7000 + 512, 512, 8192),
    }
    # a holder that failed while the source itself lives (a copy failed): back to the source
    given, missing = reroute(index, version(A, B, C), ops, {"b"}, {})
    assert missing == [] and [holder for holder, _ in given] == ["a", "a"] and [op for _, op in given] == ops


def test_ranges_nobody_else_holds_are_named_by_tensor_and_byte_range() -> None:
    index = HolderIndex(version(A, B, C))
    ops = [ReadOp("a", 0x2000 + 64, 128, 0), ReadOp("a", 0x1000, 1024, 1024)]
    _, missing = reroute(index, version(A, B, C), ops, {"a", "b", "c"}, {})
    assert missing == [("emb", 64, 192), ("norm", 0, 1024)]
    assert describe_ranges(missing, {"norm": 1024, "emb": 2048}) == "emb bytes [64, 192); norm (all 1024 bytes)"
    many = [(f"t{i:02d}", 0, 10) for i in range(11)]
    text = describe_ranges(many)
    assert text.count("bytes [0, 10)") == 8 and text.endswith("and 3 more tensors (30 bytes)")


class ScriptedFailures:
    """A transport whose reads fail as scripted (a real transport's failures need real processes:
    those are in tests/faults). Records every request it was asked to read."""

    def __init__(self, failures: list[tuple[tuple[str, ...], frozenset[str]]]) -> None:
        self.failures = list(failures)
        self.asked: list[dict[str, list[tuple[int, int, int]]]] = []
        self.forgotten: list[str] = []

    def read(self, sources, requests, arena, *, timeout_s, abort_check=None, gone=None) -> ReadReport:
        self.asked.append({sid: list(r) for sid, r in requests.items()})
        if self.failures:
            failed, completed = self.failures.pop(0)
            raise TransferError(f"READ failed from {failed}", failed_sources=failed, completed_sources=completed)
        nbytes = {sid: sum(n for _, _, n in r) for sid, r in requests.items()}
        return ReadReport(nbytes, {sid: "nixl" for sid in requests}, sum(len(r) for r in requests.values()))

    def forget(self, source_id: str) -> None:
        self.forgotten.append(source_id)


def _pull(info: VersionInfo, transport: ScriptedFailures):
    plan = plan_full_tensors(info)
    grouped: dict[str, list] = {}
    for op in plan.reads:
        grouped.setdefault(op.source_id, []).append((op.remote_addr, op.local_offset, op.nbytes))
    requests = {sid: coalesce(ops) for sid, ops in grouped.items()}
    chosen = {s.source_id: s for s in info.sources}
    pulled = pull_with_failover(transport, info, chosen, requests, None, timeout_s=1.0, abort_check=None,
                                edges=lambda s: [], label="refit of model 'm' version 7")
    return plan, requests, pulled


def test_confirmed_batches_are_kept_and_everything_else_is_read_again_from_live_holders() -> None:
    info = version(A, B, C)
    # a fails, b was confirmed, c was not (its batch is unconfirmed, so it is read again)
    transport = ScriptedFailures([(("a",), frozenset({"b"}))])
    plan, requests, pulled = _pull(info, transport)
    assert pulled.failed_over == ("a",) and transport.forgotten == ["a"]
    second = transport.asked[1]
    assert set(second) == {"c"}  # b's batch was confirmed: not read again; a is never asked again
    a_norm = next(op for op in plan.reads if op.source_id == "a")
    # c's unconfirmed batch again, plus a's norm from c's copy (c carried less load than b),
    # landing at the arena offset the plan gave it
    assert set(requests["c"]) <= set(second["c"])
    assert (0x7000, a_norm.local_offset, 1024) in second["c"]
    assert pulled.bytes_reread == sum(op.nbytes for op in plan.reads if op.source_id == "a") == 1024
    assert sum(pulled.report.nbytes.values()) == sum(op.nbytes for op in plan.reads)


def test_a_second_failure_during_the_failover_is_failed_over_too_or_aborts_naming_both() -> None:
    info = version(A, B, C)
    # a fails; then b fails while reading what a owed: c still holds norm, but nobody else
    # holds emb or b's shard of w
    transport = ScriptedFailures([(("a",), frozenset()), (("b",), frozenset({"c"}))])
    with pytest.raises(TransferError) as caught:
        _pull(info, transport)
    err = caught.value
    assert err.failed_sources == ("a", "b") and err.source_id == "b"
    assert "source 'a', 'b' failed mid-pull" in str(err) and "nothing was loaded" in str(err)
    assert ("w", "bytes [0, 512)") in err.missing
    assert "w (all 512 bytes)" in str(err)


def test_an_error_that_names_no_source_is_not_failed_over() -> None:
    transport = ScriptedFailures([((), frozenset())])
    with pytest.raises(TransferError, match=r"READ failed from \(\)"):
        _pull(version(A, B, C), transport)
    assert len(transport.asked) == 1


def test_a_failed_replicas_reads_go_back_to_the_trainer_bytes_it_mirrors_or_to_a_named_replica() -> None:
    # replica r holds a's norm and emb at 0x100000; replica q holds a's emb only
    r = SourceInfo("r", MeshPosition(), "agent-r", b"meta", (), True,
                   mirrors=(Mirror("a", 0x1000, 1024, 0x100000), Mirror("a", 0x2000, 2048, 0x100400)))
    q = SourceInfo("q", MeshPosition(), "agent-q", b"meta", (), True, mirrors=(Mirror("a", 0x2000, 2048, 0x200000),))
    info = VersionInfo("m", 7, VersionState.READY, 3, (A, B, C), replicas=(r, q))
    op = ReadOp("r", 0x100000 + 1000, 100, 64)  # the last 24 bytes of norm, the first 76 of emb
    mapped, unmapped = in_source_space(r, op, {"a", "b", "c"})
    assert mapped == [ReadOp("a", 0x1000 + 1000, 24, 64), ReadOp("a", 0x2000, 76, 88)] and unmapped == []
    _, unmapped = in_source_space(r, ReadOp("r", 0x200000, 8, 0), {"a", "b", "c"})
    assert unmapped == [ReadOp("r", 0x200000, 8, 0)]
    index = HolderIndex(info)
    # r failed, a lives: back to a, at the same arena bytes
    given, missing = reroute(index, info, mapped, {"r"}, {}, replicas=["q"])
    assert missing == [] and {h for h, _ in given} <= {"a", "q"}
    # a and r dead: emb from q (named in the lease), norm from b or c (same bytes)
    given, missing = reroute(index, info, mapped, {"a", "r"}, {}, replicas=["q"])
    assert missing == []
    assert ("q", ReadOp("q", 0x200000, 76, 88)) in given
    assert [h for h, o in given if o.local_offset == 64] in (["b"], ["c"])
    # q not named in the lease: its arena is not protected, so emb comes from b instead
    given, _ = reroute(index, info, mapped, {"a", "r"}, {}, replicas=[])
    assert [h for h, o in given if o.local_offset == 88] == ["b"]
