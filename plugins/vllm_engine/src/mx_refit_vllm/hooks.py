"""mx-refit hook implementations for vLLM workers (entry point ``mx_refit: vllm``).

Lets any :class:`mx_refit.receiver.Receiver` built with ``engine=<vLLM model or mx engine>``
(e.g. by a Dynamo or NeMo RL integration) find the worker's target layout without knowing vLLM.
"""

from __future__ import annotations

from typing import Any

from mx_refit import hookimpl
from mx_refit.types import TargetLayout


def _is_vllm_model(engine: Any) -> bool:
    return type(engine).__module__.startswith("vllm.model_executor.models.")


@hookimpl
def mx_refit_target_layout(engine: Any) -> TargetLayout | None:
    """The layout of the vLLM worker that owns ``engine`` (an mx engine or a vLLM model)."""
    if type(engine).__name__ == "MxWeightTransferEngine" and type(engine).__module__ == "mx_refit_vllm.engine":
        from mx_refit_vllm.layout import target_layout

        return engine.layout or target_layout(engine.parallel_config)
    if _is_vllm_model(engine):
        from vllm.config import get_current_vllm_config

        from mx_refit_vllm.layout import target_layout

        return target_layout(get_current_vllm_config().parallel_config)
    return None
