"""Builders shared by the catalog tests (a plain module: imported, not a conftest)."""

from __future__ import annotations

import math
from typing import Any

from mx_refit.catalog import CatalogService
from mx_refit.types import (
    DTYPE_SIZES,
    MemType,
    MeshPosition,
    Role,
    SourceInfo,
    TensorDescriptor,
    VersionInfo,
)


class FakeClock:
    """A manual monotonic clock for TTL tests."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def desc(
    name: str = "w",
    *,
    dtype: str = "float32",
    global_shape: tuple[int, ...] = (4, 8),
    local_shape: tuple[int, ...] | None = None,
    shard_axis: int = -1,
    shard_offset: int = 0,
    addr: int = 0x1000,
    nbytes: int | None = None,
    role: Role | str = Role.REPLICATED,
    mem_type: MemType | str = MemType.DRAM,
    device_id: int = 0,
    extras: dict[str, Any] | None = None,
) -> TensorDescriptor:
    """A valid descriptor unless told otherwise (nbytes follows local_shape and dtype)."""
    local = global_shape if local_shape is None else local_shape
    if nbytes is None:
        nbytes = math.prod(local) * DTYPE_SIZES.get(dtype, 1)
    return TensorDescriptor(
        name=name,
        dtype=dtype,
        global_shape=global_shape,
        local_shape=local,
        addr=addr,
        nbytes=nbytes,
        role=role,  # type: ignore[arg-type]
        shard_axis=shard_axis,
        shard_offset=shard_offset,
        mem_type=mem_type,  # type: ignore[arg-type]
        device_id=device_id,
        extras=extras or {},
    )


def column_shard(name: str, rank: int, size: int, rows: int = 8, cols: int = 4) -> TensorDescriptor:
    """Rank ``rank``'s COLUMN shard (dim 0) of a (rows, cols) float32 tensor."""
    part = rows // size
    return desc(
        name,
        global_shape=(rows, cols),
        local_shape=(part, cols),
        shard_axis=0,
        shard_offset=rank * part,
        role=Role.COLUMN,
        addr=0x10000 * (rank + 1),
    )


def source(
    source_id: str = "s0",
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    ep_rank: int = 0,
    ep_size: int = 1,
    tensors: tuple[TensorDescriptor, ...] | None = None,
    metadata: bytes = b"nixl-metadata",
    ready: bool = False,
) -> SourceInfo:
    return SourceInfo(
        source_id=source_id,
        mesh=MeshPosition(tp_rank=tp_rank, tp_size=tp_size, ep_rank=ep_rank, ep_size=ep_size),
        agent_name=f"agent-{source_id}",
        agent_metadata=metadata,
        tensors=(desc(),) if tensors is None else tensors,
        ready=ready,
    )


def tp_source(rank: int, size: int, *, ready: bool = False) -> SourceInfo:
    """Rank ``rank`` of a TP group: one COLUMN shard and one replicated tensor."""
    return source(
        f"tp{rank}",
        tp_rank=rank,
        tp_size=size,
        # At least one row per rank: the catalog refuses a version whose shards leave rows unpublished.
        tensors=(column_shard("qkv", rank, size, rows=max(8, size)), desc("norm", global_shape=(4,), addr=0x90)),
        ready=ready,
    )


def publish_ready(
    catalog: Any, model: str, version: int, size: int = 2, sidecar: dict[str, Any] | None = None
) -> None:
    """Register ``size`` TP ranks of ``(model, version)`` and mark them ready."""
    for rank in range(size):
        catalog.register_source(model, version, size, tp_source(rank, size), sidecar, ttl_s=30)
    for rank in range(size):
        catalog.mark_ready(model, version, f"tp{rank}")


def snapshot(service: CatalogService, models: tuple[str, ...] = ("m",)) -> dict[str, Any]:
    """Everything observable about ``models``: summaries and full manifests in any state."""
    out: dict[str, Any] = {}
    for model in models:
        summaries = service.list_versions(model)
        manifests: list[VersionInfo] = [
            service.inspect_version(model, s.version) for s in summaries
        ]
        out[model] = (summaries, manifests)
    return out
