"""``MxRefitWorkerExtension``: a one-call refit inside each vLLM worker, for deployments that use
vLLM's ``worker_extension_cls`` slot (Dynamo's development-branch MX contract).

vLLM's ``WorkerWrapperBase.init_worker`` appends the extension to the Worker's bases after
checking that none of its names clashes with the Worker's, so the class has no ``__init__``,
two public methods and only ``_mx_refit_*`` private names; it composes by multiple inheritance
with Dynamo's own extensions::

    class MyExtension(MxRefitWorkerExtension, FpmGcWorkerExtension): ...   # Dynamo 1.6.1
    class MyExtension(MxRefitWorkerExtension, DynamoWorkerExtension): ...  # Dynamo main

Reach it through Dynamo 1.6.1's generic route on a paused worker::

    POST /engine/update_weights_from_distributed
      {"engine_rpc": "update_weights_via_mx", "version": 7, "mx_config": {...}}

That route discards return values, so a failed refit **raises** (the route then answers
``status: error``) and the worker keeps its previous weights. The upstream config keys are
mapped by :func:`~mx_refit_dynamo.mx_config.map_mx_config`.
"""

from __future__ import annotations

import logging
from typing import Any

from mx_refit.config import check_count
from mx_refit.errors import FailedPrecondition, InvalidArgument
from mx_refit_dynamo.mx_config import map_mx_config

__all__ = ["MxRefitWorkerExtension", "compose_with_dynamo"]
# ``mx_refit_dynamo.extension.DynamoComposedExtension`` (resolved lazily, see ``__getattr__``) is
# the qualname to give vLLM's ``--worker-extension-cls`` for the composed class.

log = logging.getLogger(__name__)


class MxRefitWorkerExtension:
    """Worker-extension mixin (see the module docstring). State lives in ``_mx_refit_*``
    attributes created lazily on the worker, so nothing clashes with vLLM's Worker."""

    def prepare_refit_info(
        self, state_dict_info: dict[str, Any] | None = None, *, mx_config: dict[str, Any] | None = None
    ) -> None:
        """The upstream handshake before the first update.

        ``state_dict_info`` (parameter name -> shape/dtype, as upstream trainers send it) is
        checked for form only: mx-refit needs no pre-announced layout, since every version's
        descriptors and sidecar are in the catalog and the engine refuses tensors the model
        lacks before touching any weight. With ``mx_config`` the receiving engine is
        initialised now (catalog reachable, layout fixed), so the first update does not.
        """
        if state_dict_info is not None and (
            not isinstance(state_dict_info, dict) or not all(isinstance(k, str) for k in state_dict_info)
        ):
            raise InvalidArgument(
                "state_dict_info: expected a dict keyed by parameter names, "
                f"got {type(state_dict_info).__name__}"
            )
        if mx_config is not None:
            mapped = map_mx_config(mx_config, default_model=self._mx_refit_model_name())
            self._mx_refit_init(mapped.init_info)

    def update_weights_via_mx(
        self, *, version: int, mx_config: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Pull ``version`` from the mx-refit catalog and load it; raise on any failure.

        ``mx_config`` takes the upstream keys (``mx_server_url``, ``timeout_seconds``, ...);
        without it the last init stands (from :meth:`prepare_refit_info` or a previous call).
        Returns a small JSON-safe summary; callers that only see Dynamo's route rely on the
        raise instead, since that route discards return values.
        """
        check_count(version, "version", minimum=0)
        mapped = map_mx_config(mx_config, version=version, default_model=self._mx_refit_model_name())
        if mx_config is not None:
            self._mx_refit_init(mapped.init_info)
        elif getattr(self, "_mx_refit_init_info", None) is None:
            raise FailedPrecondition(
                "update_weights_via_mx: no mx_config given and none recorded; pass mx_config "
                "(mx_server_url, ...) or call prepare_refit_info(mx_config=...) first"
            )
        update = {**mapped.update_info, "version": version}
        engine = self._mx_refit_engine()
        if engine is getattr(self, "weight_transfer_engine", None):
            # The worker's own `mx` engine: through vLLM's Worker methods, which keep its session
            # flag right (a failed update_weights resets it; finish resets the LoRA state).
            self.start_weight_update()  # type: ignore[attr-defined]
            self.update_weights(update)  # type: ignore[attr-defined]
            self.finish_weight_update()  # type: ignore[attr-defined]
        else:
            from vllm.config import set_current_vllm_config

            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                engine.start_weight_update()
                engine.update_weights(update)  # a failure resets its session, weights untouched
                engine.finish_weight_update()
        stats = list(getattr(engine, "last_stats", None) or [])
        summary = {
            "status": "ok",
            "version": version,
            "tensors": sum(getattr(s, "tensors", 0) for s in stats),
            "bytes": sum(getattr(s, "bytes_pulled", 0) for s in stats),
        }
        log.info("mx: worker loaded version %d (%d tensors)", version, summary["tensors"])
        return summary

    # -- private, prefixed: vLLM refuses an extension whose names clash with the Worker's ----------
    def _mx_refit_model_name(self) -> str | None:
        config = getattr(self, "vllm_config", None)
        model_config = getattr(config, "model_config", None)
        served = getattr(model_config, "served_model_name", None)
        if isinstance(served, (list, tuple)):
            served = served[0] if served else None
        return served or getattr(model_config, "model", None)

    def _mx_refit_engine(self) -> Any:
        """The worker's own engine when it runs mx-refit's backend, else one built for it."""
        from mx_refit_vllm.engine import MxWeightTransferEngine  # type: ignore[import-not-found]

        own = getattr(self, "weight_transfer_engine", None)
        if isinstance(own, MxWeightTransferEngine):
            return own
        built = getattr(self, "_mx_refit_own_engine", None)
        if built is None:
            from vllm.config.weight_transfer import WeightTransferConfig

            # Built from the class, not the factory: the name "mx" may belong to another package.
            built = MxWeightTransferEngine(
                WeightTransferConfig(backend="mx"),
                self.vllm_config,  # type: ignore[attr-defined]
                self.device,  # type: ignore[attr-defined]
                self.model_runner.get_model(),  # type: ignore[attr-defined]
            )
            self._mx_refit_own_engine = built
        return built

    def _mx_refit_init(self, init_info: dict[str, Any]) -> None:
        """Initialise the engine once per distinct init info."""
        if getattr(self, "_mx_refit_init_info", None) == init_info:
            return
        engine = self._mx_refit_engine()
        if engine is getattr(self, "weight_transfer_engine", None):
            self.init_weight_transfer_engine(dict(init_info))  # type: ignore[attr-defined]
        else:
            engine.init_transfer_engine(engine.parse_init_info(dict(init_info)))
        self._mx_refit_init_info = dict(init_info)


def compose_with_dynamo() -> type:
    """``MxRefitWorkerExtension`` combined with Dynamo's worker extension when one is installed:
    ``DynamoWorkerExtension`` (Dynamo main, which recognises its KV-metadata method only on
    subclasses of it), else the bare mixin (Dynamo 1.6.1 fills the slot only in benchmark mode,
    with an exact-name check that refuses any other class)."""
    try:
        from dynamo.vllm.worker_extension import DynamoWorkerExtension  # type: ignore[import-not-found]
    except ImportError:
        return MxRefitWorkerExtension
    namespace = {"__module__": __name__, "__qualname__": "DynamoComposedExtension"}
    return type("DynamoComposedExtension", (MxRefitWorkerExtension, DynamoWorkerExtension), namespace)


def __getattr__(name: str) -> Any:
    if name == "DynamoComposedExtension":
        composed = compose_with_dynamo()
        globals()[name] = composed  # one class per process, so vLLM's bases check sees the same one
        return composed
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
