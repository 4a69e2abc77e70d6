"""mx-refit hook implementations for vLLM workers (entry point ``mx_refit: vllm``).

Lets any :class:`mx_refit.Receiver` built with ``engine=<vLLM model or mx engine>``
(e.g. by a Dynamo or NeMo RL integration) find the worker's target layout without knowing vLLM.
"""

from __future__ import annotations

from typing import Any

from mx_refit import hookimpl
from mx_refit.types import TargetLayout


def _is_mx_engine(engine: Any) -> bool:
    kind = type(engine)
    return kind.__name__ == "MxWeightTransferEngine" and kind.__module__ == "mx_refit_vllm.engine"


def _is_vllm_model(engine: Any) -> bool:
    return type(engine).__module__.startswith("vllm.model_executor.models.")


@hookimpl
def mx_refit_target_layout(engine: Any) -> TargetLayout | None:
    """The layout of the vLLM worker that owns ``engine``: the mx engine's own (rank-exact
    where it can place the windows), or whole HF tensors for a bare vLLM model, whose
    ``load_weights`` narrows full tensors itself."""
    if _is_mx_engine(engine):
        from mx_refit_vllm.layout import target_layout

        return engine.layout or target_layout(
            engine.parallel_config, getattr(getattr(engine, "vllm_config", None), "quant_config", None)
        )
    if _is_vllm_model(engine):
        from types import SimpleNamespace

        from vllm.config import vllm as vllm_config_module

        from mx_refit_vllm.layout import target_layout

        # Inside a worker the process groups say everything; the config (when one is current)
        # adds the expert-parallel settings.
        current = getattr(vllm_config_module, "get_current_vllm_config_or_none", lambda: None)()
        if current is None:
            return target_layout(SimpleNamespace())
        return target_layout(current.parallel_config, getattr(current, "quant_config", None))
    return None


@hookimpl
def mx_refit_direct_targets(
    engine: Any, tensors: list[tuple[str, tuple[int, ...], str]]
) -> dict[str, Any] | None:
    """``receive_mode: direct`` into the mx engine's model: names checked (before any byte), and
    a row writer for every rank window placed straight into a vLLM parameter."""
    if _is_mx_engine(engine):
        return engine.direct_targets(tensors)  # type: ignore[no-any-return]
    return None


@hookimpl
def mx_refit_load_weights(engine: Any, weights: list[tuple[str, Any]]) -> bool | None:
    """``receive_mode: direct``: whole tensors of one chunk into the mx engine's model (rank
    windows placed, the rest through vLLM's ``load_weights``)."""
    if _is_mx_engine(engine):
        engine.load_direct(weights)
        return True
    return None
