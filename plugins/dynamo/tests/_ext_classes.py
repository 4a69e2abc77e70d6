"""Extension classes the tests hand to vLLM's ``worker_extension_cls`` (by qualname)."""

from __future__ import annotations

from dynamo.vllm.gc_policy import FpmGcWorkerExtension

from mx_refit_dynamo import MxRefitWorkerExtension


class WithFpmGc(MxRefitWorkerExtension, FpmGcWorkerExtension):
    """mx-refit's mixin composed with Dynamo 1.6.1's own worker extension."""
