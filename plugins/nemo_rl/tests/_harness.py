"""The core's process harness for Megatron ranks on CPU (``mx_refit.verify.harness``), plus an
in-place weight load that stands for a training step."""

from __future__ import annotations

from typing import Any

from mx_refit.verify.harness import (  # noqa: F401 - re-exported for the rank scripts
    apply_cpu_shims,
    build_model_from_hf,
    init_distributed,
    init_model_parallel,
)


def cpu_load_hf_weights(bridge: Any, chunks: list[Any], hf_dir: str) -> None:
    """Megatron-Bridge's own HF -> Megatron load into the existing parameters (in place), with
    ``Tensor.cuda()`` kept on the CPU as the harness does while building a model."""
    import torch

    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        bridge.load_hf_weights(chunks, hf_dir)
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]
