"""Bad input at every step: a clear error naming the cause, weights untouched, session reset.

Versions here are published from the test process itself (a real NIXL agent; the worker pulls
from it across processes). After each failure the worker's live weights must still equal, byte
for byte, the last version it loaded, and vLLM's worker must accept a new session.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mx_refit.testing.checkpoints import load_version
from mx_refit.testing.procs import RemoteError, refused_address


@pytest.fixture(scope="module")
def publish(mx_catalog: str) -> Iterator:
    """``publish(model, version, tensors, expected_sources=1)``: keeps publishers and tensors alive."""
    from mx_refit.publisher import Publisher

    publishers: dict[tuple[str, int], Publisher] = {}
    alive = []

    def _publish(model: str, version: int, tensors: list, expected_sources: int = 1) -> str:
        key = (model, expected_sources)
        if key not in publishers:
            publishers[key] = Publisher(
                mx_catalog,
                model,
                expected_sources=expected_sources,
                source_id=f"{model}/test-{expected_sources}",
            )
        alive.append(tensors)
        return publishers[key].publish(version, tensors).value

    yield _publish
    for pub in publishers.values():
        pub.close()


def _full(hf_dir: Path) -> list:
    from mx_refit.types import PublishedTensor

    # clone(): safetensors hands out back-to-back storages, and the core transport currently
    # coalesces remote ranges across the publisher's separate registrations (NIXL_ERR_NOT_FOUND);
    # separately allocated tensors, like a trainer's parameters, are what this test is about.
    return [PublishedTensor(name, tensor.clone()) for name, tensor in load_version(hf_dir).items()]


def _assert_failed_cleanly(workers, exc: RemoteError, *fragments: str) -> None:
    for fragment in fragments:
        assert fragment in exc.message, f"{fragment!r} not in: {exc.message}"
    stats = workers.stats()
    assert not any(s["active"] or s["session"] for s in stats), "the failed update left a session open"
    workers.assert_untouched()
    workers.rpc("start_weight_update")  # vLLM accepts a new session right away
    workers.rpc("finish_weight_update")
    workers.assert_untouched()


@pytest.fixture(scope="module")
def good(worker_groups, publish, mx_catalog: str, ckpts: dict[int, Path]) -> str:
    """Two READY versions of one model; the worker loads the newest through ``min_version``.

    Its weights then equal checkpoint 4: every failure below must leave them so.
    """
    tp1, name = worker_groups[1], "vllm-errors-good"
    assert publish(name, 1, _full(ckpts[1])) == "READY"
    assert publish(name, 2, _full(ckpts[4])) == "READY"
    tp1.refit({"catalog": mx_catalog, "model": name}, {"min_version": 1}, ckpts[4])
    assert tp1.stats()[0]["last_update"] == {
        "version": None, "min_version": 1, "wait_s": None, "model": None, "phase": "load"
    }
    return name


def test_catalog_unreachable_at_init(tp1) -> None:
    with refused_address() as address, pytest.raises(RemoteError) as info:
        tp1.rpc("init_weight_transfer_engine", init_info={"catalog": address, "model": "m"})
    assert info.value.kind == "Unavailable"
    assert f"catalog unreachable at {address}" in info.value.message
    tp1.assert_untouched()


def test_catalog_unreachable_during_update(tp1, good) -> None:
    from mx_refit.catalog.server import start_embedded

    server = start_embedded()
    tp1.rpc("init_weight_transfer_engine", init_info={"catalog": server.address, "model": good})
    server.stop(0)
    tp1.rpc("start_weight_update")
    with pytest.raises(RemoteError) as info:
        tp1.rpc("update_weights", update_info={"version": 1})
    assert info.value.kind == "Unavailable"
    _assert_failed_cleanly(tp1, info.value, f"catalog unreachable at {server.address}")


def test_unknown_version(tp1, good, mx_catalog: str) -> None:
    tp1.rpc("init_weight_transfer_engine", init_info={"catalog": mx_catalog, "model": good})
    tp1.rpc("start_weight_update")
    with pytest.raises(RemoteError) as info:
        tp1.rpc("update_weights", update_info={"version": 77})
    assert info.value.kind == "NotFound"
    _assert_failed_cleanly(tp1, info.value, "77")


def test_version_never_ready(tp1, good, publish, mx_catalog: str, ckpts: dict[int, Path]) -> None:
    # One of two expected trainer ranks published: the version stays PENDING.
    assert publish(good, 5, _full(ckpts[3]), expected_sources=2) == "PENDING"
    tp1.rpc("init_weight_transfer_engine", init_info={"catalog": mx_catalog, "model": good})
    tp1.rpc("start_weight_update")
    with pytest.raises(RemoteError) as info:
        tp1.rpc("update_weights", update_info={"version": 5, "wait_s": 0.5})
    assert info.value.kind == "FailedPrecondition"
    _assert_failed_cleanly(tp1, info.value, "5", "PENDING")


def test_unknown_model_name(tp1, good, mx_catalog: str) -> None:
    tp1.rpc("init_weight_transfer_engine", init_info={"catalog": mx_catalog, "model": good + "-nope"})
    tp1.rpc("start_weight_update")
    with pytest.raises(RemoteError) as info:
        tp1.rpc("update_weights", update_info={})
    assert info.value.kind == "NotFound"
    _assert_failed_cleanly(tp1, info.value, good + "-nope")


def test_tensors_the_model_does_not_have(tp1, good, publish, mx_catalog: str, model_name: str) -> None:
    """A version of another model (GPT-2 names, a wrong hidden size) is refused before loading."""
    import torch

    from mx_refit.types import PublishedTensor

    other = model_name + "-gpt2"
    tensors = [
        PublishedTensor("transformer.h.0.attn.c_attn.weight", torch.randn(64, 192)),
        PublishedTensor("model.norm.weight", torch.randn(32)),
        PublishedTensor("model.layers.0.self_attn.q_proj.weight", torch.randn(64, 48)),
    ]
    assert publish(other, 1, tensors) == "READY"
    tp1.rpc("init_weight_transfer_engine", init_info={"catalog": mx_catalog, "model": other})
    tp1.rpc("start_weight_update")
    with pytest.raises(RemoteError) as info:
        tp1.rpc("update_weights", update_info={"version": 1})
    assert info.value.kind == "InvalidArgument"
    _assert_failed_cleanly(
        tp1,
        info.value,
        "3 tensor(s)",
        "transformer.h.0.attn.c_attn.weight: the model has no such parameter",
        "model.norm.weight: shape (32,)",
        "q_proj.weight: shape (64, 48)",
    )


def test_direct_refuses_before_the_first_byte_and_names_a_partial_update(
    tp1, good, publish, mx_catalog: str, model_name: str, ckpts: dict[int, Path]
) -> None:
    """``receive_mode: direct``: a version the engine would refuse (``model.norm.weight`` of the
    wrong shape) is refused before the first byte with strict names (weights untouched); without
    them the engine fails only at that tensor, after earlier chunks were written: the error says
    the parameters are partially updated and names the version, and the engine reports no
    version loaded until a refit succeeds."""
    import torch

    from mx_refit.types import PublishedTensor

    bad = model_name + "-bad"
    tensors = [t for t in _full(ckpts[2]) if t.name != "model.norm.weight"]
    tensors.append(PublishedTensor("model.norm.weight", torch.randn(32)))
    assert publish(bad, 1, tensors) == "READY"
    assert publish(bad, 2, _full(ckpts[3])) == "READY"
    init = {"catalog": mx_catalog, "model": bad, "receive_mode": "direct", "receive_buffer_bytes": 16384}
    tp1.rpc("init_weight_transfer_engine", init_info=init)
    tp1.rpc("start_weight_update")
    with pytest.raises(RemoteError) as info:
        tp1.rpc("update_weights", update_info={"version": 1})
    assert info.value.kind == "InvalidArgument"
    _assert_failed_cleanly(tp1, info.value, "model.norm.weight: shape (32,)")

    tp1.rpc("init_weight_transfer_engine", init_info={**init, "strict_names": False})
    tp1.rpc("start_weight_update")
    with pytest.raises(RemoteError) as info:
        tp1.rpc("update_weights", update_info={"version": 1})
    assert info.value.kind == "PartiallyUpdated"
    assert "part of version 1 and part of the previous weights; do not serve them, refit again" in info.value.message
    (stats,) = tp1.stats()
    assert stats["partially_updated"] == (bad, 1) and stats["receive"] is None
    assert not (stats["active"] or stats["session"])
    tp1.refit(init, {"version": 2}, ckpts[3])  # the caller refits again: every parameter right
    assert tp1.stats()[0]["partially_updated"] is None


def test_coverage_gap(tp1, good, publish, mx_catalog: str, model_name: str, ckpts: dict[int, Path]) -> None:
    """Only half of a sharded tensor was published: the catalog refuses to make the version
    READY, naming the tensor and the rows, so no worker is ever offered it."""
    from mx_refit.errors import FailedPrecondition
    from mx_refit.types import PublishedTensor, Role

    gap = model_name + "-gap"
    tensors = _full(ckpts[2])
    for i, t in enumerate(tensors):
        if t.name == "model.layers.1.mlp.down_proj.weight":
            half = t.tensor[:32].contiguous()
            tensors[i] = PublishedTensor(t.name, half, Role.COLUMN, (64, 128), 0, 0)
    with pytest.raises(FailedPrecondition, match=r"model\.layers\.1\.mlp\.down_proj\.weight: dim 0 \[32, 64\) of 64"):
        publish(gap, 1, tensors)
    tp1.assert_untouched()


@pytest.mark.parametrize(
    ("method", "payload", "fragment"),
    [
        ("init_weight_transfer_engine", {"init_info": {"catalog": "localhost:1"}}, "model"),
        (
            "init_weight_transfer_engine",
            {"init_info": {"catalog": "no-port", "model": "m"}},
            "MxInitInfo.catalog",
        ),
        (
            "init_weight_transfer_engine",
            {"init_info": {"catalog": "h:1", "model": "m", "lease_ttl_s": -1}},
            "MxInitInfo.lease_ttl_s",
        ),
        (
            "init_weight_transfer_engine",
            {"init_info": {"catalog": "h:1", "model": "m", "checksums": "yes"}},
            "MxInitInfo.checksums",
        ),
        (
            "init_weight_transfer_engine",
            {"init_info": {"catalog": "h:1", "model": "m", "receive_mode": "drect"}},
            "MxInitInfo.receive_mode: 'drect' (expected 'staged' or 'direct')",
        ),
        (
            "init_weight_transfer_engine",
            {"init_info": {"catalog": "h:1", "model": "m", "receive_mode": "direct", "receive_buffer_bytes": 0}},
            "MxInitInfo.receive_buffer_bytes: must be an integer >= 4096, got 0",
        ),
        (
            "init_weight_transfer_engine",
            {"init_info": {"catalog": "h:1", "model": "m", "receive_mode": "direct", "checksums": True}},
            "MxInitInfo.checksums: True verifies a whole version before loading",
        ),
        ("update_weights", {"update_info": {"version": "3"}}, "MxUpdateInfo.version"),
        ("update_weights", {"update_info": {"versoin": 3}}, "versoin"),
        ("update_weights", {"update_info": {"version": 2, "min_version": 5}}, "MxUpdateInfo.min_version"),
    ],
)
def test_malformed_infos(tp1, good, mx_catalog: str, method: str, payload: dict, fragment: str) -> None:
    tp1.rpc("init_weight_transfer_engine", init_info={"catalog": mx_catalog, "model": good})
    if method == "update_weights":
        tp1.rpc("start_weight_update")
    with pytest.raises(RemoteError) as info:
        tp1.rpc(method, **payload)
    assert info.value.kind in ("ValueError", "InvalidArgument")
    _assert_failed_cleanly(tp1, info.value, fragment)


def test_checksums_catch_a_flipped_bit_before_the_worker_loads(tp1, good, mx_catalog: str, ckpts: dict[int, Path]) -> None:
    """``MxInitInfo.checksums``: a bit flipped in the trainer's memory after the publish fails the
    update naming the tensor, and a version published without checksums is refused."""
    import torch
    from mx_refit.publisher import Publisher

    tp1.rpc("init_weight_transfer_engine", init_info={"catalog": mx_catalog, "model": good, "checksums": True})
    tp1.rpc("start_weight_update")
    with pytest.raises(RemoteError) as info:
        tp1.rpc("update_weights", update_info={"version": 2})
    assert info.value.kind == "TransferError"
    _assert_failed_cleanly(tp1, info.value, "published no checksums")

    name = good + "-sums"
    tensors = _full(ckpts[2])
    with Publisher(mx_catalog, name, source_id=f"{name}/sums", checksums=True) as pub:
        pub.publish(1, tensors)
        flipped = tensors[len(tensors) // 2]
        flipped.tensor.view(-1).view(torch.uint8)[11] ^= 1 << 6
        tp1.rpc("init_weight_transfer_engine", init_info={"catalog": mx_catalog, "model": name, "checksums": True})
        tp1.rpc("start_weight_update")
        with pytest.raises(RemoteError) as info:
            tp1.rpc("update_weights", update_info={"version": 1})
        assert info.value.kind == "ChecksumMismatch"
        _assert_failed_cleanly(tp1, info.value, repr(flipped.name), "nothing was loaded")
