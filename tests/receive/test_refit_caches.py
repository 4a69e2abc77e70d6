"""The receiver's per-cycle caches never serve stale state: real catalog (gRPC), real NIXL.

A plan is reused only while every source's layout digest and the sidecar digest are unchanged;
views are reused only for the same plan and arena, with the new bytes visible through them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from mx_refit.publisher import Publisher
from mx_refit.receive.plans import layout_key as _layout_key
from mx_refit.receive.receiver import Receiver
from mx_refit.types import TargetLayout

pytestmark = pytest.mark.timeout(180)


def _counting(fn: Callable[..., Any], calls: list[int]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return fn(*args, **kwargs)

    return wrapper


def test_plan_and_views_cached_until_layout_or_sidecar_changes(mx_catalog: str, mx_model_name: str) -> None:
    from mx_refit.types import PublishedTensor

    weight = torch.arange(32, dtype=torch.float32).view(4, 8)
    bias = torch.arange(8, dtype=torch.float32)
    tensors = [PublishedTensor("w", weight), PublishedTensor("b", bias)]
    plans: list[int] = []
    with Publisher(mx_catalog, mx_model_name) as pub, Receiver(mx_catalog, mx_model_name) as rec:
        rec.hooks.plan_receive = _counting(rec.hooks.plan_receive, plans)  # a spy on the real planner

        def cycle(version: int, published: list[PublishedTensor], sidecar: dict[str, Any]) -> dict[str, Any]:
            if version > 1:
                pub.wait_drained(version - 1, timeout_s=30)
            pub.publish(version, published, sidecar=sidecar)
            result = rec.refit(version)
            got = dict(result.tensors)
            assert set(got) == {t.name for t in published}
            for t in published:
                assert torch.equal(got[t.name], t.tensor), (version, t.name)
            return got

        v1 = cycle(1, tensors, {"note": 1})
        assert len(plans) == 1
        weight.add_(1000)  # the optimizer step, in place
        v2 = cycle(2, tensors, {"note": 1})
        assert len(plans) == 1  # same layout, same sidecar: the cached plan
        assert v2["w"] is v1["w"] and v2["b"] is v1["b"]  # and the same views, showing new bytes
        v3 = cycle(3, tensors, {"note": 2})
        assert len(plans) == 2  # the sidecar changed: planned again
        bigger = [PublishedTensor("w", torch.randn(8, 8)), PublishedTensor("b", bias)]
        v4 = cycle(4, bigger, {"note": 2})
        assert len(plans) == 3  # the layout changed: planned again, never the stale plan
        assert v4["w"].shape == (8, 8) and v3["w"].shape == (4, 8)
        renamed = [PublishedTensor("w2", bigger[0].tensor), PublishedTensor("b", bias)]
        cycle(5, renamed, {"note": 2})  # same buffers, another name: a new layout digest
        assert len(plans) == 4


def test_layout_key_tracks_digests_not_versions(mx_catalog: str, mx_model_name: str) -> None:
    """Version number and agent metadata do not change the key; a layout or sidecar digest,
    the target, or the model does."""
    import dataclasses

    from mx_refit.types import PublishedTensor

    with Publisher(mx_catalog, mx_model_name) as pub, Receiver(mx_catalog, mx_model_name) as rec:
        pub.publish(1, [PublishedTensor("w", torch.ones(4))], sidecar={"k": 1})
        info = rec.discover(1)
    assert info.sidecar_digest and all(s.layout_digest for s in info.sources)
    target = TargetLayout()
    key = _layout_key(info, target)
    later = dataclasses.replace(
        info, version=7, sources=tuple(dataclasses.replace(s, agent_metadata=b"other") for s in info.sources)
    )
    assert _layout_key(later, target) == key
    assert _layout_key(dataclasses.replace(info, sidecar_digest="0" * 32), target) != key
    moved = tuple(dataclasses.replace(s, layout_digest="1" * 32) for s in info.sources)
    assert _layout_key(dataclasses.replace(info, sources=moved), target) != key
    assert _layout_key(info, TargetLayout(tp_size=2, tp_rank=1, full_tensors=False)) != key
    assert _layout_key(dataclasses.replace(info, model="other"), target) != key


def test_stats_split_the_whole_refit_into_its_steps(mx_catalog: str, mx_model_name: str) -> None:
    from mx_refit.types import PublishedTensor

    with Publisher(mx_catalog, mx_model_name) as pub, Receiver(mx_catalog, mx_model_name) as rec:
        for version in (1, 2):
            pub.publish(version, [PublishedTensor("w", torch.full((64,), float(version)))])
            began = time.perf_counter()
            stats = rec.refit(version).stats
            wall = time.perf_counter() - began
            pub.wait_drained(version, timeout_s=30)
        phases = stats.phase_seconds
        assert list(phases) == ["discover", "plan", "lease", "heartbeat_start", "pull", "verify", "release",
                                "materialize", "load"]
        assert all(v >= 0 for v in phases.values())
        assert phases["pull"] == stats.seconds and phases["plan"] == stats.plan_seconds
        assert sum(phases.values()) <= wall
