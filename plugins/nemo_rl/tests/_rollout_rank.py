"""One NeMo RL vLLM rollout worker (one TP rank) in its own process (vLLM 0.33 venv, CPU, gloo).

The worker object is the plugin's ``MxVllmWorker`` created the way NeMo RL's ``NixlVllmWorker``
is (its ``__new__`` runs first), with NeMo RL's worker extension appended to its bases the way
vLLM's ``WorkerWrapperBase.init_worker`` appends ``worker_extension_cls`` (the reproduced
``VllmCheckpointEngineMixin``). Its ``model_runner.model`` is vLLM's own ``Qwen2ForCausalLM``
built with ``initialize_model`` at this TP rank and loaded from the version-0 checkpoint. A
second instance is the oracle: vLLM's loader fed the checkpoint directly.

Protocol: ``("rpc", (method, args))`` runs a worker method with positional args, as
``collective_rpc`` does; ``("check", hf_dir)``; ``("digests", None)`` of what the last update
received in sink mode (``("sink", True)``: the loading loop's batches are recorded, not loaded);
``("reset_engine", None)`` (a new job); ``("stats", None)``; ``("stop", None)``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "nemo_rl_repro"))
sys.path.insert(0, str(HERE))

from mx_refit.testing.checkpoints import tensor_digest as digest  # noqa: E402
from mx_refit.testing.procs import open_child, rank_arguments, serve  # noqa: E402


class RolloutProcess:
    def __init__(self, rank: int, world: int, dist_init: str, hf_dir: str) -> None:
        from types import SimpleNamespace

        from mx_refit.testing.checkpoints import load_version
        from _nemo_rl_contract import VllmCheckpointEngineMixin
        from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.model_executor.model_loader.utils import initialize_model

        from mx_refit_nemo_rl.vllm_worker import MxVllmWorker

        self.vllm_config = VllmConfig(
            model_config=ModelConfig(model=hf_dir, dtype="float32", enforce_eager=True, skip_tokenizer_init=True),
            parallel_config=ParallelConfig(tensor_parallel_size=world),
            device_config=DeviceConfig(device="cpu"),
        )
        self._ctx = set_current_vllm_config
        # vLLM's WorkerWrapperBase.init_worker (v1/worker/worker_base.py) appends the extension
        # class to the worker class's bases before creating the worker.
        worker_cls = type("MxVllmWorkerWithExtension", (MxVllmWorker,), {})
        worker_cls.__bases__ = worker_cls.__bases__ + (VllmCheckpointEngineMixin,)
        self.worker = worker_cls.__new__(worker_cls, self.vllm_config)  # the NIXL agent: before vLLM init
        self.agent_created_before_init = self.worker.mx_refit_transport is not None
        with set_current_vllm_config(self.vllm_config):
            init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                         distributed_init_method=dist_init)
            initialize_model_parallel(world, 1, backend="gloo")
            self.model = initialize_model(vllm_config=self.vllm_config)
            self.model.load_weights(list(load_version(hf_dir).items()))
            self.reference = initialize_model(vllm_config=self.vllm_config, prefix="reference")
        self.received: dict[str, str] = {}
        self.worker.vllm_config = self.vllm_config
        self.worker.draft_weights = {}
        self.worker.model_runner = SimpleNamespace(model=self.model)

    def finalize_engine(self) -> None:
        engine = self.worker.checkpoint_engine
        if engine is not None:
            engine.finalize()

    def reset_engine(self) -> None:
        """A new NeMo RL job on the same vLLM model."""
        self.finalize_engine()
        self.worker.checkpoint_engine = None
        self.worker.draft_weights = {}

    def set_sink(self, sink: bool) -> None:
        self.worker.model_runner.model = _Sink(self) if sink else self.model

    def rpc(self, method: str, args: tuple) -> object:
        with self._ctx(self.vllm_config):
            if method == "update_weights_from_checkpoint_engine":
                self.received = {}
            return getattr(self.worker, method)(*args)

    def check(self, hf_dir: str) -> dict:
        import torch
        from mx_refit.testing.checkpoints import load_version

        with self._ctx(self.vllm_config):
            self.reference.load_weights(list(load_version(hf_dir).items()))
        live = dict(self.model.named_parameters())
        ref = dict(self.reference.named_parameters())
        assert live.keys() == ref.keys()
        mismatched = [n for n, t in live.items()
                      if t.shape != ref[n].shape or not torch.equal(t.detach().view(torch.uint8),
                                                                    ref[n].detach().view(torch.uint8))]
        return {"compared": len(live), "mismatched": mismatched}

    def stats(self) -> dict:
        engine = self.worker.checkpoint_engine
        stats = getattr(engine, "last_stats", None)
        transport = self.worker.mx_refit_transport
        return {
            "agent_created_before_init": self.agent_created_before_init,
            "same_agent": engine is not None and engine._transport is transport,
            "registrations": transport.registrations,
            "new_registrations": None if stats is None else stats.new_registrations,
            "bytes_pulled": None if stats is None else stats.bytes_pulled,
            "version": None if engine is None else engine.version,
            "side": None if engine is None else engine.side,
            "arena_device": None if engine is None or engine._receiver is None else engine._receiver.device,
            "loaded": getattr(self.worker, "loaded", None),
            "draft": {n: digest(t) for n, t in self.worker.draft_weights.items()},
        }


class _Sink:
    """Stands in for vLLM's model only where the stream carries names no vLLM model here has
    (FP8 KV/Q scales): records what the loading loop was given."""

    def __init__(self, proc: RolloutProcess) -> None:
        self.proc = proc

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            self.proc.received[name] = digest(tensor)


def main() -> None:
    parser = rank_arguments()
    parser.add_argument("--hf-dir", required=True)
    args = parser.parse_args()
    opened = open_child(
        args.listen, lambda: RolloutProcess(args.rank, args.world, args.dist_init, args.hf_dir), rank=args.rank
    )
    if opened is None:
        return
    conn, proc = opened
    serve(conn, {
        "rpc": lambda arg: proc.rpc(*arg),
        "reset_engine": lambda _: proc.reset_engine(),
        "sink": lambda arg: proc.set_sink(bool(arg)),
        "check": proc.check,
        "digests": lambda _: dict(proc.received),
        "stats": lambda _: proc.stats(),
    }, on_stop=proc.finalize_engine)


if __name__ == "__main__":
    main()
