"""``MxVllmWorker``: the vLLM worker class the recipes select (``vllm_kwargs.worker_cls``).

It creates this process's NIXL agent before vLLM initialises (CUDA, NCCL, the model), as NeMo
RL's own ``NixlVllmWorker`` does for its engine (``vllm_backend.py:120-126``), and registers
itself so the checkpoint engine built later in this process knows it is on the rollout side.
NeMo RL still appends its worker extension (the checkpoint-engine RPCs and loading loop) to this
class's bases through vLLM's ``worker_extension_cls`` mechanism; nothing here overrides it.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.gpu_worker import Worker

from mx_refit_nemo_rl.owner import register_rollout_worker

__all__ = ["MxVllmWorker"]


class MxVllmWorker(Worker):
    """vLLM's GPU worker with mx-refit's NIXL agent created first."""

    def __new__(cls, *args: Any, **kwargs: Any) -> MxVllmWorker:
        import mx_refit

        worker = super().__new__(cls)
        worker.mx_refit_transport = mx_refit.shared_transport()
        register_rollout_worker(worker)
        return worker
