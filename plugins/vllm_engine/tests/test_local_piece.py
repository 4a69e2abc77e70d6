"""Where a trainer rank's ``iter_local`` piece sits, from vLLM's ``ParamMeta`` placements."""

from __future__ import annotations

import pytest

vllm_base = pytest.importorskip("vllm.distributed.weight_transfer.base")
ParamMeta, Replicate, Shard = vllm_base.ParamMeta, vllm_base.Replicate, vllm_base.Shard


def _pieces(meta, world: int) -> list:
    from mx_refit_vllm.trainer import local_piece

    return [local_piece(meta, rank, world_size=world) for rank in range(world)]


def test_uneven_chunks_like_torch_chunk() -> None:
    import torch

    meta = ParamMeta("w", torch.float32, (131, 8), owners=(0, 1, 2), placements=(Shard(0),))
    assert _pieces(meta, 3) == [(0, 0, 44), (0, 44, 44), (0, 88, 43)]
    assert [c.shape[0] for c in torch.chunk(torch.empty(131, 8), 3)] == [44, 44, 43]
    # torch.chunk leaves the last rank empty here: it publishes nothing.
    tiny = ParamMeta("b", torch.float32, (3,), owners=(0, 1, 2, 3), placements=(Shard(0),))
    assert _pieces(tiny, 4) == [(0, 0, 1), (0, 1, 1), (0, 2, 1), (0, 3, 0)]


def test_two_mesh_axes_outer_first_and_replicas_publish_once() -> None:
    import torch

    # 2 x 2 mesh over ranks 4..7: axis 0 replicates, axis 1 shards dim 1.
    meta = ParamMeta(
        "w",
        torch.float32,
        (4, 10),
        owners=(4, 5, 6, 7),
        mesh_shape=(2, 2),
        placements=(Replicate(), Shard(1)),
    )
    from mx_refit_vllm.trainer import local_piece

    assert [local_piece(meta, r) for r in range(8)] == [None] * 4 + [(1, 0, 5), (1, 5, 5), None, None]
    # Both axes shard dim 0: outer axis first, then the inner one inside it.
    nested = ParamMeta(
        "w", torch.float32, (10, 2), owners=(0, 1, 2, 3), mesh_shape=(2, 2), placements=(Shard(0), Shard(0))
    )
    assert [local_piece(nested, r) for r in range(4)] == [(0, 0, 3), (0, 3, 2), (0, 5, 3), (0, 8, 2)]


def test_unowned_everywhere_params_spread_and_two_dims_rejected() -> None:
    import torch

    from mx_refit.errors import InvalidArgument
    from mx_refit_vllm.trainer import local_piece

    plain = ParamMeta("n", torch.float32, (8,))
    assert [local_piece(plain, r, index=5, world_size=2) for r in range(2)] == [None, (-1, 0, 0)]
    two = ParamMeta(
        "w", torch.float32, (4, 4), owners=(0, 1, 2, 3), mesh_shape=(2, 2), placements=(Shard(0), Shard(1))
    )
    with pytest.raises(InvalidArgument, match="shard tensor dims"):
        local_piece(two, 0)
