"""Every malformed or conflicting request: exact error class, a message naming field and
value, and catalog state untouched afterwards."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from catalog_factories import FakeClock, desc, publish_ready, snapshot, source, tp_source

from mx_refit.catalog import CatalogLimits, CatalogService
from mx_refit.errors import FailedPrecondition, InvalidArgument, MxRefitError, NotFound
from mx_refit.types import MeshPosition, Role, SourceInfo


@pytest.fixture
def seeded(make_service, clock: FakeClock) -> CatalogService:
    """A catalog holding one READY version (1) and one PENDING version (2, tp0 of 2)."""
    service = make_service(clock=clock)
    publish_ready(service, "m", 1, sidecar={"arch": "dense", "hf_name_map": {"a": "b"}})
    service.register_source("m", 2, 2, tp_source(0, 2), {"arch": "dense"})
    return service


def assert_rejected(
    service: CatalogService,
    call: Callable[[], Any],
    error: type[MxRefitError],
    *fragments: str,
) -> None:
    """``call`` raises exactly ``error`` mentioning every fragment, and changes nothing."""
    before = snapshot(service)
    with pytest.raises(MxRefitError) as caught:
        call()
    assert type(caught.value) is error, f"{type(caught.value).__name__}: {caught.value}"
    for fragment in fragments:
        assert fragment in str(caught.value), f"{fragment!r} not in {str(caught.value)!r}"
    assert snapshot(service) == before


def register_one(service: CatalogService, *tensors: Any, **kwargs: Any) -> Callable[[], Any]:
    """A registration of tp1 (completing version 2) carrying ``tensors``; its sidecar adds a
    key, so that a partial commit of a rejected request would show."""
    src = source("tp1", tp_rank=1, tp_size=2, tensors=tensors, **kwargs)
    return lambda: service.register_source("m", 2, 2, src, {"arch": "dense", "new_key": 1})


# --- descriptors -----------------------------------------------------------------------------

BAD_DESCRIPTORS = [
    pytest.param(
        desc(name=""), "source.tensors[0].name: must be a non-empty string, got ''", id="empty-name"
    ),
    pytest.param(
        desc(dtype="float13"), "source.tensors[0].dtype: unknown dtype 'float13'", id="dtype"
    ),
    pytest.param(
        desc(dtype="float32", global_shape=(32, 64), nbytes=4096),
        "source.tensors[0].nbytes: 4096 does not match local_shape (32, 64) x float32 = 8192 bytes",
        id="nbytes",
    ),
    pytest.param(
        desc(global_shape=(4, 8), local_shape=(2, 8), shard_axis=2),
        "source.tensors[0].shard_axis: 2 is out of range for the 2-dim global_shape (4, 8)",
        id="axis-too-big",
    ),
    pytest.param(
        desc(global_shape=(4, 8), local_shape=(2, 8), shard_axis=-2),
        "source.tensors[0].shard_axis: -2 is out of range",
        id="axis-negative",
    ),
    pytest.param(
        desc(global_shape=(8, 4), local_shape=(4, 4), shard_axis=0, shard_offset=6),
        "source.tensors[0].shard_offset: 6 + local extent 4 exceeds global_shape[0] = 8",
        id="offset-past-end",
    ),
    pytest.param(
        desc(global_shape=(8, 4), local_shape=(4, 4), shard_axis=0, shard_offset=-1),
        "source.tensors[0].shard_offset: -1 is negative",
        id="offset-negative",
    ),
    pytest.param(
        desc(global_shape=(8, 4), local_shape=(4, 4)),
        "source.tensors[0].local_shape: (4, 4) differs from global_shape (8, 4) but "
        "shard_axis is -1",
        id="unsharded-shape-mismatch",
    ),
    pytest.param(
        desc(global_shape=(8, 4), shard_offset=2),
        "source.tensors[0].shard_offset: 2 must be 0 when shard_axis is -1",
        id="unsharded-offset",
    ),
    pytest.param(
        desc(global_shape=(8, 4), local_shape=(4, 2), shard_axis=0),
        "source.tensors[0].local_shape: (4, 2) differs from global_shape (8, 4) on dim 1",
        id="non-axis-dim",
    ),
    pytest.param(
        desc(global_shape=(8, 4), local_shape=(8,)),
        "source.tensors[0].local_shape: (8,) has 1 dims but global_shape (8, 4) has 2",
        id="ndim",
    ),
    pytest.param(
        desc(global_shape=(4, -8), nbytes=0),
        "source.tensors[0].global_shape[1]: -8 is negative",
        id="neg-dim",
    ),
    pytest.param(desc(addr=-1), "source.tensors[0].addr: -1 is negative", id="addr"),
    pytest.param(
        desc(device_id=-1), "source.tensors[0].device_id: -1 is below the minimum of 0", id="device"
    ),
    pytest.param(
        desc(shard_axis=True),
        "source.tensors[0].shard_axis: must be an integer, got True",
        id="bool-axis",
    ),
    pytest.param(
        desc(role="diagonal"), "source.tensors[0].role: unknown value 'diagonal'", id="role"
    ),
    pytest.param(
        desc(mem_type="HBM"), "source.tensors[0].mem_type: unknown value 'HBM'", id="mem-type"
    ),
    pytest.param(
        desc(extras={"f": float("nan")}),
        'source.tensors[0].extras["f"]: nan is not a finite number',
        id="extras-nan",
    ),
    pytest.param(
        desc(extras={"groups": [1, {"x": object()}]}),
        'source.tensors[0].extras["groups"][1]["x"]: object value',
        id="extras-object",
    ),
    pytest.param(
        desc(extras={1: "int key"}),  # type: ignore[dict-item]
        "source.tensors[0].extras: key 1 is not a string",
        id="extras-int-key",
    ),
]


@pytest.mark.parametrize(("bad", "message"), BAD_DESCRIPTORS)
def test_malformed_descriptor(seeded: CatalogService, bad: Any, message: str) -> None:
    assert_rejected(seeded, register_one(seeded, bad), InvalidArgument, message)


def test_error_names_the_descriptor_index_and_tensor(seeded: CatalogService) -> None:
    tensors = (desc("a"), desc("b", addr=64), desc("c", addr=-5))
    assert_rejected(
        seeded, register_one(seeded, *tensors), InvalidArgument, "source.tensors[2].addr", "'c'"
    )


def test_duplicate_tensor_names_within_a_source(seeded: CatalogService) -> None:
    tensors = (desc("a"), desc("b"), desc("a", addr=256))
    assert_rejected(
        seeded,
        register_one(seeded, *tensors),
        InvalidArgument,
        "source.tensors[2].name: 'a' duplicates source.tensors[0] of source 'tp1'",
    )


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (
            desc("norm", global_shape=(4,), dtype="bfloat16"),
            "source.tensors[0].dtype: 'bfloat16' for tensor 'norm' disagrees with 'float32' "
            "registered by source 'tp0'",
        ),
        (
            desc("norm", global_shape=(5,)),
            "source.tensors[0].global_shape: (5,) for tensor 'norm' disagrees with (4,)",
        ),
        (
            desc("norm", global_shape=(4,), role=Role.COLUMN),
            "source.tensors[0].role: column for tensor 'norm' disagrees with replicated",
        ),
    ],
)
def test_ranks_must_agree_on_the_full_tensor(
    seeded: CatalogService, tensor: Any, message: str
) -> None:
    assert_rejected(seeded, register_one(seeded, tensor), InvalidArgument, message)


# --- sources ---------------------------------------------------------------------------------


def test_duplicate_mesh_position(seeded: CatalogService) -> None:
    twin = source("tp0-twin", tp_rank=0, tp_size=2)
    assert_rejected(
        seeded,
        lambda: seeded.register_source("m", 2, 2, twin),
        InvalidArgument,
        "source.mesh: position (tp 0/2, pp 0/1, ep 0/1) of source 'tp0-twin' is already held "
        "by source 'tp0'",
    )


def test_duplicate_source_id_after_pending(seeded: CatalogService) -> None:
    again = source("tp0", tp_rank=0, tp_size=2, tensors=(desc(addr=0x77),))
    assert_rejected(
        seeded,
        lambda: seeded.register_source("m", 1, 2, again),
        FailedPrecondition,
        "model 'm' version 1 is READY; source 'tp0' cannot be replaced",
    )


def test_expected_sources_mismatch(seeded: CatalogService) -> None:
    assert_rejected(
        seeded,
        lambda: seeded.register_source("m", 2, 4, tp_source(1, 4)),
        InvalidArgument,
        "expected_sources: 4 does not match 2 registered earlier for model 'm' version 2",
    )


def test_more_sources_than_expected(seeded: CatalogService) -> None:
    seeded.register_source("m", 3, 1, source("a"))
    assert_rejected(
        seeded,
        lambda: seeded.register_source("m", 3, 1, source("b", tp_rank=1, tp_size=2)),
        InvalidArgument,
        "expected_sources: model 'm' version 3 already has all 1 expected sources (a); "
        "'b' is not one of them",
    )


@pytest.mark.parametrize(
    ("mesh", "message"),
    [
        (MeshPosition(tp_rank=2, tp_size=2), "source.mesh.tp_rank: must be in [0, 2), got 2"),
        (MeshPosition(pp_size=0), "source.mesh.pp_size: must be >= 1, got 0"),
        (MeshPosition(ep_rank="0"), "source.mesh.ep_rank: must be an integer, got '0'"),  # type: ignore[arg-type]
    ],
)
def test_bad_mesh(seeded: CatalogService, mesh: MeshPosition, message: str) -> None:
    bad = SourceInfo("tp1", mesh, "agent", b"", (desc(),))
    assert_rejected(
        seeded, lambda: seeded.register_source("m", 2, 2, bad), InvalidArgument, message
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"model": ""}, InvalidArgument, "model: must be a non-empty string, got ''"),
        ({"version": -1}, InvalidArgument, "version: -1 is below the minimum of 0"),
        ({"expected_sources": 0}, InvalidArgument, "expected_sources: 0 is below the minimum of 1"),
        ({"ttl_s": 0}, InvalidArgument, "ttl_s: 0 must be > 0"),
        ({"ttl_s": float("inf")}, InvalidArgument, "ttl_s: inf must be > 0"),
        ({"ttl_s": float("nan")}, InvalidArgument, "ttl_s: nan must be > 0"),
        ({"ttl_s": 1e9}, InvalidArgument, "ttl_s: 1000000000.0 must be > 0 and <= 86400 seconds"),
        ({"sidecar": {"zz": 1, "arch": "moe"}}, InvalidArgument, 'sidecar["arch"]: "moe" from'),
        ({"sidecar": ["not", "a", "map"]}, InvalidArgument, "sidecar: must be a mapping, got list"),
        ({"source": "tp1"}, InvalidArgument, "source: expected a SourceInfo, got str"),
    ],
)
def test_bad_registration_arguments(
    seeded: CatalogService, kwargs: dict[str, Any], error: type[MxRefitError], message: str
) -> None:
    args: dict[str, Any] = {
        "model": "m",
        "version": 2,
        "expected_sources": 2,
        "source": tp_source(1, 2),
        "sidecar": {"new_key": [1, 2]},
        "ttl_s": 30.0,
    } | kwargs
    assert_rejected(seeded, lambda: seeded.register_source(**args), error, message)


def test_agent_name_and_source_id_must_be_set(seeded: CatalogService) -> None:
    for bad, message in [
        (SourceInfo("", MeshPosition(), "a", b"", ()), "source.source_id: must be a non-empty"),
        (SourceInfo("x", MeshPosition(), "", b"", ()), "source.agent_name: must be a non-empty"),
        (SourceInfo("x", MeshPosition(), "a", "text", ()), "source.agent_metadata: must be bytes"),  # type: ignore[arg-type]
    ]:

        def register(bad: SourceInfo = bad) -> None:
            seeded.register_source("m", 9, 1, bad)

        assert_rejected(seeded, register, InvalidArgument, message)


def test_rejected_replacement_keeps_the_previous_incarnation(seeded: CatalogService) -> None:
    broken = source("tp0", tp_rank=0, tp_size=2, tensors=(desc(nbytes=3),))
    assert_rejected(
        seeded, lambda: seeded.register_source("m", 2, 2, broken), InvalidArgument, "nbytes: 3"
    )
    seeded.register_source("m", 2, 2, tp_source(1, 2), {"arch": "dense"})
    conflicting = tp_source(0, 2)  # conflicts with tp1, not with its own previous incarnation
    assert_rejected(
        seeded,
        lambda: seeded.register_source("m", 2, 2, conflicting, {"arch": "moe"}),
        InvalidArgument,
        'sidecar["arch"]: "moe" from source \'tp0\' conflicts with "dense"',
    )


# --- limits ----------------------------------------------------------------------------------


def test_agent_metadata_limit_is_16_mib(seeded: CatalogService) -> None:
    too_big = source("tp1", tp_rank=1, tp_size=2, metadata=b"\0" * (16 * 2**20 + 1))
    assert_rejected(
        seeded,
        lambda: seeded.register_source("m", 2, 2, too_big),
        InvalidArgument,
        "source.agent_metadata: 16777217 bytes exceeds the limit of 16777216 bytes",
    )


def test_descriptor_and_sidecar_limits(make_service, clock: FakeClock) -> None:
    service = make_service(
        clock=clock, limits=CatalogLimits(max_descriptors_per_source=3, max_sidecar_bytes=32)
    )
    service.register_source("m", 1, 2, tp_source(0, 2))
    many = tuple(desc(f"t{i}", addr=64 * i) for i in range(4))
    assert_rejected(
        service,
        register_one(service, *many),
        InvalidArgument,
        "source.tensors: 4 descriptors exceed the limit of 3 per source",
    )
    src = tp_source(1, 2)
    assert_rejected(
        service,
        lambda: service.register_source("m", 1, 2, src, {"blob": "x" * 40}),
        InvalidArgument,
        "sidecar: 51 bytes of JSON exceeds the limit of 32 bytes",
    )


def test_default_limits_match_the_design() -> None:
    limits = CatalogLimits()
    assert limits.max_agent_metadata_bytes == 16 * 2**20
    assert limits.max_descriptors_per_source == 1_000_000
    assert limits.max_sidecar_bytes == 64 * 2**20


# --- unknown things and wrong states ---------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda s: s.get_version("nope"), NotFound, "model: unknown model 'nope' (known: m)"),
        (lambda s: s.get_version("m", 7), NotFound, "version: model 'm' has no version 7"),
        (lambda s: s.mark_ready("m", 7, "tp0"), NotFound, "has no version 7"),
        (
            lambda s: s.mark_ready("m", 2, "ghost"),
            NotFound,
            "source_id: 'ghost' is not registered for model 'm' version 2 (registered: tp0)",
        ),
        (lambda s: s.acquire_lease("nope", 1, "r"), NotFound, "unknown model 'nope'"),
        (
            lambda s: s.release_lease("ghost"),
            NotFound,
            "lease_id: unknown or expired lease 'ghost'",
        ),
        (lambda s: s.heartbeat(["ghost"]), NotFound, "unknown or expired source_ids ['ghost']"),
        (lambda s: s.retire_version("m", 7), NotFound, "has no version 7"),
        (lambda s: s.wait_drained("m", 7, 0), NotFound, "has no version 7"),
        (
            lambda s: s.acquire_lease("m", 2, "r"),
            FailedPrecondition,
            "model 'm' version 2 is PENDING; only READY versions can be leased",
        ),
        (lambda s: s.get_version("m", 2), FailedPrecondition, "version 2 is PENDING, not READY"),
        (lambda s: s.wait_drained("m", 1, 1), FailedPrecondition, "is READY; retire it before"),
        (lambda s: s.heartbeat("tp0"), InvalidArgument, "source_ids: must be a sequence of ids"),
        (lambda s: s.heartbeat([""]), InvalidArgument, "source_ids[0]: must be a non-empty string"),
        (lambda s: s.acquire_lease("m", 1, ""), InvalidArgument, "reader_id: must be a non-empty"),
        (
            lambda s: s.acquire_lease("m", 1, "r", ttl_s=-1),
            InvalidArgument,
            "ttl_s: -1 must be > 0",
        ),
        (lambda s: s.acquire_lease("m", 1, "r", lease_id=""), InvalidArgument, "lease_id: must be"),
        (lambda s: s.wait_drained("m", 1, -1), InvalidArgument, "timeout_s: -1 must be >= 0"),
        (lambda s: s.wait_drained("m", 1, 4000), InvalidArgument, "<= 3600 seconds"),
        (lambda s: s.get_version("m", min_version=-2), InvalidArgument, "min_version: -2 is below"),
        (lambda s: s.list_versions(""), InvalidArgument, "model: must be a non-empty string"),
    ],
)
def test_unknown_and_wrong_state(
    seeded: CatalogService,
    call: Callable[[CatalogService], Any],
    error: type[MxRefitError],
    message: str,
) -> None:
    assert_rejected(seeded, lambda: call(seeded), error, message)


def test_expired_lease_is_not_found(seeded: CatalogService, clock: FakeClock) -> None:
    lease = seeded.acquire_lease("m", 1, "r", ttl_s=1)
    clock.advance(2)
    seeded.heartbeat(source_ids=["tp0", "tp1"])
    assert_rejected(
        seeded, lambda: seeded.release_lease(lease), NotFound, f"unknown or expired lease '{lease}'"
    )


def test_a_lease_fence_must_be_finite_and_non_negative(seeded: CatalogService) -> None:
    for bad in (-1.0, math.inf, math.nan, "5", True):
        broken = replace(source("fence"), lease_fence_s=bad)  # type: ignore[arg-type]
        assert_rejected(
            seeded, lambda broken=broken: seeded.register_source("m", 9, 1, broken), InvalidArgument,
            "source.lease_fence_s:",
        )
    seeded.register_source("m", 9, 1, replace(source("fence"), lease_fence_s=12.5))
    seeded.mark_ready("m", 9, "fence")
    assert seeded.get_manifest("m", 9).sources[0].lease_fence_s == 12.5
