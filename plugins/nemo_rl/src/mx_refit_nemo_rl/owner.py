"""Find the NeMo RL worker that owns a checkpoint engine, with no NeMo RL patches.

NeMo RL hands a checkpoint engine only a bucket size, its kwargs, rank metadata and (policy side)
a lazy generator of exported HF tensors. The engine runs inside the worker's process, so it can
find its owner itself. Two strategies, tried in this order on the policy side:

1. **The generator's frame** (at every ``send_weights``). NeMo RL passes the unstarted generator
   of ``MegatronPolicyWorkerImpl._iter_params_with_optional_kv_scales``
   (``megatron_policy_worker.py:2328``); its frame holds ``self`` (the worker) and ``kv_scales``.
   When NeMo RL wrapped it in the target-layout generator expression
   (``policy/workers/checkpoint_engine.py:95``), the wrapped generator is that frame's ``.0``.
2. **The call stack** (at construction). ``checkpoint_engine_rpc`` -> ``create_checkpoint_engine``
   -> ``cls(...)`` (``policy/workers/checkpoint_engine.py:145-155``,
   ``utils/checkpoint_engines/base.py:101-113``): the first caller frame whose ``self`` looks
   like a Megatron policy worker is the owner.

A policy worker is recognised by what the engine reads from it (duck typing: NeMo RL is not
importable next to this module in every environment): ``megatron_bridge``, ``model`` and the
cached ``refit_conversion_tasks`` (``megatron_policy_worker.py:2297``).
"""

from __future__ import annotations

import inspect
import sys
import weakref
from dataclasses import dataclass
from types import FrameType
from typing import Any

__all__ = [
    "PolicyOwner",
    "find_in_stack",
    "from_weights",
    "is_policy_worker",
    "register_rollout_worker",
    "rollout_worker",
    "unwrap_generator",
]

_REQUIRED = ("megatron_bridge", "model")


def is_policy_worker(obj: Any) -> bool:
    """True for an object that carries what a Megatron policy worker carries for refit."""
    if obj is None or isinstance(obj, type):
        return False
    return all(hasattr(obj, attr) for attr in _REQUIRED) and (
        hasattr(obj, "refit_conversion_tasks") or hasattr(obj, "_build_refit_conversion_tasks")
    )


@dataclass
class PolicyOwner:
    """The owning worker and how it was found (``"generator"`` or ``"stack"``)."""

    worker: Any
    strategy: str
    kv_scales: dict[str, float] | None = None


def unwrap_generator(weights: Any) -> Any:
    """The innermost unstarted generator behind NeMo RL's optional target-layout genexpr."""
    seen = 0
    while seen < 4:
        frame = getattr(weights, "gi_frame", None)
        if frame is None:
            return weights
        if is_policy_worker(frame.f_locals.get("self")):
            return weights
        inner = frame.f_locals.get(".0")
        if inner is None:
            return weights
        weights = inner
        seen += 1
    return weights


def from_weights(weights: Any) -> PolicyOwner | None:
    """Strategy 1: the worker from the export generator's frame, with the KV scales it was given."""
    inner = unwrap_generator(weights)
    frame = getattr(inner, "gi_frame", None)
    if frame is None:
        return None
    worker = frame.f_locals.get("self")
    if not is_policy_worker(worker):
        return None
    return PolicyOwner(worker=worker, strategy="generator", kv_scales=frame.f_locals.get("kv_scales"))


def find_in_stack(predicate: Any = is_policy_worker, *, skip: int = 1, limit: int = 64) -> Any:
    """Strategy 2: the nearest caller's ``self`` that satisfies ``predicate`` (``None`` if none)."""
    frame: FrameType | None = sys._getframe(skip)
    depth = 0
    try:
        while frame is not None and depth < limit:
            candidate = frame.f_locals.get("self")
            if candidate is not None and predicate(candidate):
                return candidate
            frame = frame.f_back
            depth += 1
        return None
    finally:
        del frame


def describe(obj: Any) -> str:
    """``module.Class`` of an object, for error messages."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}" if not inspect.isclass(obj) else repr(obj)


# -- rollout side: the vLLM worker class registers itself (no introspection needed there) --------

_ROLLOUT_WORKERS: list[weakref.ref[Any]] = []


def register_rollout_worker(worker: Any) -> None:
    """Called by :class:`~mx_refit_nemo_rl.vllm_worker.MxVllmWorker` as it is created."""
    _ROLLOUT_WORKERS[:] = [ref for ref in _ROLLOUT_WORKERS if ref() is not None]
    _ROLLOUT_WORKERS.append(weakref.ref(worker))


def rollout_worker() -> Any:
    """The live mx vLLM worker of this process, or ``None`` (a policy process has none)."""
    for ref in reversed(_ROLLOUT_WORKERS):
        worker = ref()
        if worker is not None:
            return worker
    return None
