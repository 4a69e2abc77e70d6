"""Built-in plugin: the behaviour mx-refit has with no framework plugin installed.

Every implementation here is ``trylast`` so framework plugins win whenever they recognise the
object they are given.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from mx_refit.hookspecs import hookimpl
from mx_refit.types import PublishedTensor, TargetLayout

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from mx_refit.plan import ReceivePlan
    from mx_refit.types import MeshPosition, VersionInfo


def _is_tensor(value: Any) -> bool:
    # Duck-typed so this module never imports torch.
    return hasattr(value, "data_ptr") and hasattr(value, "is_contiguous")


@hookimpl(trylast=True)
def mx_refit_collect_tensors(model: Any, mesh: "MeshPosition") -> "list[PublishedTensor] | None":
    """Publish a ``{name: tensor}`` mapping or a module's parameters and buffers as full copies."""
    if isinstance(model, Mapping):
        items = list(model.items())
    elif hasattr(model, "named_parameters") and hasattr(model, "named_buffers"):
        items = list(model.named_parameters()) + list(model.named_buffers())
    else:
        return None
    published = []
    for name, tensor in items:
        if not _is_tensor(tensor):
            raise TypeError(f"tensors[{name!r}]: expected a torch.Tensor, got {type(tensor).__qualname__}")
        if not tensor.is_contiguous():
            raise ValueError(f"tensors[{name!r}]: not contiguous; publishing registers memory in place, never copies")
        published.append(PublishedTensor(name=name, tensor=tensor.detach()))
    return published


@hookimpl(trylast=True)
def mx_refit_target_layout(engine: Any) -> TargetLayout:
    return TargetLayout()


@hookimpl(trylast=True)
def mx_refit_plan_receive(version: "VersionInfo", target: "TargetLayout") -> "ReceivePlan":
    from mx_refit.plan import plan_full_tensors

    return plan_full_tensors(version)


@hookimpl(trylast=True)
def mx_refit_load_weights(engine: Any, weights: "list[tuple[str, torch.Tensor]]") -> bool | None:
    """vLLM-style ``load_weights(iterable)`` objects, or a mapping of destination tensors."""
    if hasattr(engine, "load_weights"):
        engine.load_weights(weights)
        return True
    if isinstance(engine, MutableMapping):
        for name, tensor in weights:
            if name in engine:
                engine[name].copy_(tensor)
            else:
                engine[name] = tensor.clone()
        return True
    return None


@hookimpl(trylast=True)
def mx_refit_direct_targets(
    engine: Any, tensors: "list[tuple[str, tuple[int, ...], str]]"
) -> "dict[str, Callable[[int, torch.Tensor], None]] | None":
    """A mapping of destination tensors: a row writer for every tensor it holds in that shape."""
    if not isinstance(engine, MutableMapping):
        return None
    writers: dict[str, Callable[[int, torch.Tensor], None]] = {}
    for name, shape, _ in tensors:
        dest: Any = engine.get(name)
        if dest is not None and _is_tensor(dest) and tuple(dest.shape) == tuple(shape) and len(shape) > 0:
            writers[name] = functools.partial(_write_rows, dest)
    return writers


def _write_rows(dest: "torch.Tensor", first: int, rows: "torch.Tensor") -> None:
    dest.narrow(0, first, rows.shape[0]).copy_(rows)
