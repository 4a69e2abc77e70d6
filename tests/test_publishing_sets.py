"""Which Megatron ranks publish, checked against Megatron-Core's own rank layout.

Megatron's ``RankGenerator`` (the class ``initialize_model_parallel`` builds its groups with) gives
every rank's coordinates for a mesh and a rank order; the publishing rule (``ParallelContext``'s
``publishes_dense`` / ``publishes_experts``) is applied to each rank, and the count, the coverage
and the source ids are compared with :func:`mx_refit.expected_sources` and
:func:`mx_refit.publisher.mesh_source_id`. No process group is needed: the generator is pure.
"""

from __future__ import annotations

import itertools

import pytest

import mx_refit
from mx_refit.errors import InvalidArgument
from mx_refit.megatron.parallel import ParallelContext
from mx_refit.publisher import mesh_source_id
from mx_refit.types import MeshPosition

ps = pytest.importorskip("megatron.core.parallel_state")

ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp")  # Megatron's default, and use_tp_pp_dp_mapping


def _coordinates(generator: object, token: str) -> dict[int, int]:
    """rank -> its index inside its ``token`` group."""
    return {rank: i for group in generator.get_ranks(token) for i, rank in enumerate(group)}  # type: ignore[attr-defined]


def _contexts(tp: int, pp: int, ep: int, etp: int, dp: int, cp: int, order: str) -> list[ParallelContext]:
    """Every rank's ParallelContext, as ``ParallelContext.from_parallel_state`` would read it."""
    world = tp * pp * dp * cp
    dense = ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    edp = world // (etp * ep * pp)
    expert = ps.RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order)
    tp_of, pp_of, dp_of = _coordinates(dense, "tp"), _coordinates(dense, "pp"), _coordinates(dense, "dp-cp")
    etp_of, ep_of, edp_of = _coordinates(expert, "tp"), _coordinates(expert, "ep"), _coordinates(expert, "dp")
    assert _coordinates(expert, "pp") == pp_of  # initialize_model_parallel asserts the same
    return [
        ParallelContext(tp_rank=tp_of[r], tp_size=tp, pp_rank=pp_of[r], pp_size=pp, ep_rank=ep_of[r], ep_size=ep,
                        etp_rank=etp_of[r], etp_size=etp, dp_rank=dp_of[r], edp_rank=edp_of[r])
        for r in range(world)
    ]


def _meshes() -> list[tuple[int, int, int, int, int, int]]:
    """(tp, pp, ep, etp, dp, cp) meshes Megatron accepts: world/pp divisible by etp*ep."""
    out = []
    for tp, pp, ep, etp, dp, cp in itertools.product((1, 2, 4, 8), (1, 2), (1, 2, 4), (1, 2, 4), (1, 2, 4), (1, 2)):
        if (tp * dp * cp) % (etp * ep) == 0 and tp * pp * dp * cp <= 64:
            out.append((tp, pp, ep, etp, dp, cp))
    return out


@pytest.mark.parametrize("order", ORDERS)
def test_publishing_sets_match_megatron_rank_layout(order: str) -> None:
    meshes = _meshes()
    assert len(meshes) > 100
    for tp, pp, ep, etp, dp, cp in meshes:
        label = f"tp{tp} pp{pp} ep{ep} etp{etp} dp{dp} cp{cp} {order}"
        if not order.endswith("pp") and pp > 1 and tp * dp * cp // (etp * ep) != dp:
            continue  # initialize_model_parallel refuses this order for this mesh
        ranks = _contexts(tp, pp, ep, etp, dp, cp, order)
        publishing = [c for c in ranks if c.publishes]
        assert len(publishing) == mx_refit.expected_sources(tp, pp, ep, etp), label
        assert len(publishing) == mx_refit.expected_sources(mesh=publishing[0].mesh()), label
        # Every dense position once, every expert position once.
        dense = sorted((c.tp_rank, c.pp_rank) for c in ranks if c.publishes_dense)
        assert dense == sorted(itertools.product(range(tp), range(pp))), label
        experts = sorted((c.etp_rank, c.ep_rank, c.pp_rank) for c in ranks if c.publishes_experts)
        assert experts == sorted(itertools.product(range(etp), range(ep), range(pp))), label
        # Source ids and mesh positions are unique (the catalog refuses a repeated position).
        ids = {mesh_source_id("m", c.mesh()) for c in publishing}
        assert len(ids) == len(publishing), (label, sorted(ids))
        assert len({c.mesh() for c in publishing}) == len(publishing), label


def test_the_issue_meshes() -> None:
    # ETP 1 at TP 2 x EP 2: two ranks, each publishing its dense TP shard and its experts.
    ranks = _contexts(2, 1, 2, 1, 1, 1, ORDERS[0])
    assert [(c.publishes_dense, c.publishes_experts) for c in ranks] == [(True, True), (True, True)]
    assert mx_refit.expected_sources(2, 1, 2, 1) == 2
    # TP 4 x EP 2 x ETP 1: four dense publishers, the first two also publish experts.
    ranks = _contexts(4, 1, 2, 1, 1, 1, ORDERS[0])
    assert [(c.publishes_dense, c.publishes_experts) for c in ranks] == [(True, True)] * 2 + [(True, False)] * 2
    assert [mesh_source_id("m", c.mesh()) for c in ranks] == [
        "m/tp0-pp0-ep0-etp0", "m/tp1-pp0-ep1-etp0", "m/tp2-pp0-ep0-etp0", "m/tp3-pp0-ep1-etp0"]
    # TP 1 x EP 2 x ETP 2 (expert TP wider than TP): ranks 1-3 publish experts only.
    ranks = _contexts(1, 1, 2, 2, 4, 1, ORDERS[0])
    assert [(c.publishes_dense, c.publishes_experts) for c in ranks] == [(True, True)] + [(False, True)] * 3
    assert mx_refit.expected_sources(1, 1, 2, 2) == 4
    # ETP = TP (Megatron's default): unchanged ids, tp x pp x ep sources.
    ranks = _contexts(2, 1, 2, 2, 2, 1, ORDERS[0])
    assert sorted(mesh_source_id("m", c.mesh()) for c in ranks if c.publishes) == [
        "m/tp0-pp0-ep0", "m/tp0-pp0-ep1", "m/tp1-pp0-ep0", "m/tp1-pp0-ep1"]
    assert mx_refit.expected_sources(2, 1, 2) == 4


@pytest.mark.parametrize("bad", [{"tp": 0}, {"pp": -1}, {"ep": True}, {"etp": 0}, {"tp": 1.5}])
def test_expected_sources_names_a_bad_size(bad: dict) -> None:
    name = next(iter(bad))
    with pytest.raises(InvalidArgument, match=rf"^expected_sources: {name} must be an integer >= 1"):
        mx_refit.expected_sources(**bad)


def test_mesh_etp_is_validated() -> None:
    MeshPosition(etp_rank=1, etp_size=2).validate()
    MeshPosition().validate()  # etp_size 0: not given
    with pytest.raises(InvalidArgument, match=r"^mesh.etp_rank: must be in \[0, 2\), got 2"):
        MeshPosition(etp_rank=2, etp_size=2).validate()
    with pytest.raises(InvalidArgument, match=r"^mesh.etp_rank: must be 0 when etp_size is 0"):
        MeshPosition(etp_rank=1).validate()


def test_a_version_whose_sources_leave_a_gap_is_refused_before_ready(mx_catalog, mx_model_name) -> None:
    # Two sources at one TP position (the ETP bug's symptom: a shard published twice, its
    # neighbour never) through the real catalog and NIXL: the mark that would make the version
    # READY is refused, naming the tensor and the missing rows; nothing becomes READY.
    import torch

    from mx_refit.catalog.client import CatalogClient
    from mx_refit.errors import FailedPrecondition
    from mx_refit.types import PublishedTensor, Role

    client = CatalogClient(mx_catalog)
    ranks = [mx_refit.Publisher(client, mx_model_name, mesh=MeshPosition(tp_rank=r, tp_size=2), expected_sources=2)
             for r in range(2)]
    try:
        whole = PublishedTensor("norm", torch.ones(4), Role.REPLICATED)
        ranks[0].publish(1, [PublishedTensor("w", torch.zeros(2, 3), Role.COLUMN, (4, 3), 0, 0), whole])
        with pytest.raises(FailedPrecondition, match=r"cannot cover every byte .*w: dim 0 \[2, 4\) of 4 published by no "
                                                      rf"source \(shards: \[0, 2\) by {mx_model_name}/tp0-pp0-ep0, \[0, 2\)"):
            ranks[1].publish(1, [PublishedTensor("w", torch.ones(2, 3), Role.COLUMN, (4, 3), 0, 0), whole])
        # Both sources are registered, one is ready: the other rank's wait points at the refusal.
        with pytest.raises(TimeoutError, match=r"PENDING, 1/2 sources ready; every source registered: .*leave "
                                               r"bytes unpublished"):
            ranks[0].wait_ready(1, timeout_s=0.3)
        # The same ranks publishing both halves: READY.
        ranks[0].publish(2, [PublishedTensor("w", torch.zeros(2, 3), Role.COLUMN, (4, 3), 0, 0), whole])
        ranks[1].publish(2, [PublishedTensor("w", torch.ones(2, 3), Role.COLUMN, (4, 3), 0, 2), whole])
        ranks[0].wait_ready(2, timeout_s=30)
    finally:
        for rank in ranks:
            rank.close()


def test_version_gaps_names_unpublished_names_of_the_name_map() -> None:
    from mx_refit.layout.coverage import version_gaps
    from mx_refit.types import SourceInfo, TensorDescriptor

    desc = TensorDescriptor("decoder.final_layernorm.weight", "float32", (4,), (4,), 0, 16)
    source = SourceInfo("m/tp0-pp0-ep0", MeshPosition(), "a", b"", (desc,))
    sidecar = {"megatron.config": {"tie_word_embeddings": True},
               "megatron.hf_map": {"decoder.final_layernorm.weight": {"hf": ["model.norm.weight"]},
                                   "decoder.layers.1.mlp.experts.linear_fc2.weight3": {"hf": ["x"]},
                                   "output_layer.weight": {"hf": ["lm_head.weight"]}}}
    assert version_gaps([source], sidecar) == [
        ("decoder.layers.1.mlp.experts.linear_fc2.weight3", "listed in the Megatron name map but published by no source")]
