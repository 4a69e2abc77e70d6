"""A steady refit (same layout, next version) costs the same at 30 and 1,500 tensors: real
catalog (gRPC and its express lane), real NIXL between a publisher and a receiver.

Its reply carries no per-tensor bytes (layout and agent metadata left out by digest), it
decodes none, and no Python function runs once per tensor or per range: the plan, the NIXL
descriptor lists and the views are the ones the first cycle of the layout built. A changed
layout (a new tensor, a changed shape or dtype, a new allocation) takes the full path again.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import pytest
import torch

from mx_refit.publisher import Publisher
from mx_refit.receive.receiver import Receiver
from mx_refit.types import PublishedTensor

pytestmark = pytest.mark.timeout(300)


def scattered(count: int, size: int = 256, dtype: torch.dtype = torch.uint8) -> list[PublishedTensor]:
    """``count`` tensors, each its own allocation (as HF/FSDP models and vLLM keep them)."""
    return [PublishedTensor(f"layers.{i}.w", torch.full((size,), i % 100, dtype=dtype)) for i in range(count)]


def step(tensors: list[PublishedTensor]) -> None:
    for t in tensors:
        t.tensor.add_(1)  # the optimizer step, in place


def check(result: Any, tensors: list[PublishedTensor]) -> None:
    got = dict(result.tensors)
    assert len(got) == len(tensors)
    for t in tensors:
        assert torch.equal(got[t.name], t.tensor), t.name


def profiled(fn: Any) -> tuple[Any, Counter[str]]:
    """``fn()`` and how often each Python function (and builtin) ran in this thread meanwhile."""
    calls: Counter[str] = Counter()

    def count(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            calls[f"{frame.f_code.co_filename}:{frame.f_code.co_name}"] += 1
        elif event == "c_call":
            calls[f"builtin {getattr(arg, '__qualname__', arg)}"] += 1

    sys.setprofile(count)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
    return result, calls


def steady_cycle(catalog: str, model: str, count: int) -> tuple[Counter[str], dict[str, int], int]:
    """Versions 1 and 2, then the profiled steady refit of version 3: the calls, what the reply
    carried, and the NIXL descriptor lists built during it."""
    tensors = scattered(count)
    with Publisher(catalog, model) as pub, Receiver(catalog, model, device="cpu") as rec:
        for version in (1, 2):
            if version > 1:
                pub.wait_drained(version - 1, timeout_s=60)
                step(tensors)
            pub.publish(version, tensors)
            check(rec.refit(version), tensors)
        pub.wait_drained(2, timeout_s=60)
        step(tensors)
        pub.publish(3, tensors)
        nixl = rec.transport.nixl()
        built, before = nixl.descs_built, rec.client.manifest_stats
        result, calls = profiled(lambda: rec.refit(3))
        after = rec.client.manifest_stats
        check(result, tensors)
        assert result.stats.descriptors == count  # one per separately allocated tensor
        reply = {k: getattr(after, k) - getattr(before, k) for k in ("descriptors_sent", "sources_omitted",
                                                                   "metadata_sent", "metadata_omitted")}
        return calls, reply, nixl.descs_built - built


def test_a_steady_cycle_sends_decodes_and_loops_over_no_tensor(mx_catalog: str, mx_model_name: str) -> None:
    few, reply_few, built_few = steady_cycle(mx_catalog, mx_model_name + "-few", 30)
    many, reply_many, built_many = steady_cycle(mx_catalog, mx_model_name + "-many", 1500)
    for reply in (reply_few, reply_many):
        assert reply == {"descriptors_sent": 0, "sources_omitted": 1, "metadata_sent": 0, "metadata_omitted": 1}
    assert built_few == built_many == 0  # the descriptor lists of version 2's read, posted again
    busiest = many.most_common(5)
    assert busiest[0][1] < 100, busiest  # nothing ran once per tensor (1,500 of them)
    # The same functions run at 30 and 1,500 tensors (bar the NIXL poll, which follows the clock).
    assert set(many) - set(few) <= {k for k in many if "sleep" in k or "_state" in k}, set(many) - set(few)


@pytest.mark.parametrize("change", ["new-tensor", "shape", "dtype", "reallocated"])
def test_a_changed_layout_takes_the_full_path(mx_catalog: str, mx_model_name: str, change: str) -> None:
    """Every cached part is rebuilt for a new layout, and the bytes are the new layout's."""
    tensors = scattered(40)
    plans: list[int] = []
    with Publisher(mx_catalog, mx_model_name) as pub, Receiver(mx_catalog, mx_model_name, device="cpu") as rec:
        real_plan = rec.hooks.plan_receive

        def counting(*args: Any, **kwargs: Any) -> Any:
            plans.append(1)
            return real_plan(*args, **kwargs)

        rec.hooks.plan_receive = counting  # a spy on the real planner
        nixl = None
        for version in (1, 2):
            if version > 1:
                pub.wait_drained(version - 1, timeout_s=60)
            pub.publish(version, tensors)
            check(rec.refit(version), tensors)
            nixl = rec.transport.nixl()
        assert nixl is not None and len(plans) == 1
        built = nixl.descs_built
        pub.wait_drained(2, timeout_s=60)
        if change == "new-tensor":
            tensors = [*tensors, PublishedTensor("layers.new.w", torch.full((256,), 7, dtype=torch.uint8))]
        elif change == "shape":
            tensors = [*tensors[:-1], PublishedTensor(tensors[-1].name, torch.full((512,), 9, dtype=torch.uint8))]
        elif change == "dtype":
            tensors = [*tensors[:-1], PublishedTensor(tensors[-1].name, torch.full((64,), 3, dtype=torch.float32))]
        else:  # the same names, shapes and dtypes in new allocations (new addresses)
            tensors = [PublishedTensor(t.name, t.tensor.clone().add_(5)) for t in tensors]
        before = rec.client.manifest_stats
        pub.publish(3, tensors)
        result = rec.refit(3)
        after = rec.client.manifest_stats
        check(result, tensors)
        assert len(plans) == 2  # planned again
        assert nixl.descs_built > built  # the reads prepared again
        assert after.sources_sent - before.sources_sent == 1  # the layout came over the wire
        assert after.metadata_sent - before.metadata_sent == 1  # new regions: new agent metadata
        pub.wait_drained(3, timeout_s=60)
        step(tensors)
        pub.publish(4, tensors)
        built = nixl.descs_built
        check(rec.refit(4), tensors)  # and the new layout is steady in turn
        assert len(plans) == 2 and nixl.descs_built == built
