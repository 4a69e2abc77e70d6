"""One vLLM inference worker (one TP rank) in its own process, driven by the tests.

Built the way vLLM's GPU worker builds itself, minus the GPU: the general plugins load (this is
where the ``mx`` entry point registers the backend), the TP group is a gloo group, vLLM's own
``Qwen2ForCausalLM`` is built with ``initialize_model`` and loaded from the version-0 checkpoint,
and the weight-transfer engine comes from ``WeightTransferEngineFactory.create_engine`` exactly as
``Worker.load_model`` calls it. The update RPCs then run through vLLM's real ``Worker`` methods
(``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights`` with its per-rank
list indexing and session reset, ``finish_weight_update``) on a Worker object that carries only
the attributes those methods use.

Protocol (multiprocessing.connection, pickle): ``("rpc", method, kwargs)`` (Worker methods),
``("engine", (method, kwargs))`` (engine methods directly),
``("check", hf_dir)``, ``("stats", None)``, ``("stop", None)``; replies ``("ok", value)`` or
``("err", (type_name, message))``.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # no accelerator: vLLM's CPU code paths
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from mx_refit.testing.procs import open_child, rank_arguments, serve  # noqa: E402  (after the platform is chosen)


class WorkerProcess:
    def __init__(self, rank: int, world: int, dist_init: str, hf_dir: str) -> None:
        import torch
        from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.plugins import load_general_plugins
        from vllm.v1.worker.gpu_worker import Worker
        from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

        from mx_refit.testing.checkpoints import load_version

        load_general_plugins()  # vLLM does this in every worker before load_model
        self.vllm_config = VllmConfig(
            model_config=ModelConfig(
                model=hf_dir, dtype="float32", enforce_eager=True, skip_tokenizer_init=True
            ),
            parallel_config=ParallelConfig(tensor_parallel_size=world),
            device_config=DeviceConfig(device="cpu"),
            weight_transfer_config=WeightTransferConfig(backend="mx"),
        )
        self._ctx = set_current_vllm_config
        with set_current_vllm_config(self.vllm_config):
            init_distributed_environment(
                world_size=world,
                rank=rank,
                local_rank=rank,
                backend="gloo",
                distributed_init_method=dist_init,
            )
            initialize_model_parallel(world, 1, backend="gloo")
            self.model = initialize_model(vllm_config=self.vllm_config)
            self.model.load_weights(list(load_version(hf_dir).items()))
            # A second instance needs its own layer-name prefix (vLLM keys attention layers by it);
            # parameter names are unaffected.
            self.reference = initialize_model(vllm_config=self.vllm_config, prefix="reference")
            engine = WeightTransferEngineFactory.create_engine(
                self.vllm_config.weight_transfer_config, self.vllm_config, torch.device("cpu"), self.model
            )
        runner = LoRAModelRunnerMixin()
        runner.lora_config = None  # no LoRA: reset_lora_state() is then a no-op, as in vLLM
        worker = Worker.__new__(Worker)
        worker.vllm_config = self.vllm_config
        worker.rank = rank
        worker.model_runner = runner
        worker.speculative_config = None
        worker.weight_transfer_engine = engine
        worker._weight_update_active = False
        worker._weight_update_is_draft = False
        self.worker = worker
        self.engine = engine

    def rpc(self, method: str, kwargs: dict) -> object:
        return getattr(self.worker, method)(**kwargs)

    def measured(self, method: str, kwargs: dict) -> int:
        """Run a Worker method; return the peak of torch's CPU allocations meanwhile, in bytes
        (torch's profiler records every allocation and free of the process, in order)."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            self.rpc(method, kwargs)
        current = peak = 0
        for event in prof.profiler.kineto_results.events():
            if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU:
                current += event.nbytes()
                peak = max(peak, current)
        return peak

    def check(self, hf_dir: str) -> dict:
        """Load ``hf_dir`` into the reference model through vLLM's plain loader, then compare
        every parameter of the live model with it, byte for byte."""
        import torch

        from mx_refit.testing.checkpoints import load_version

        with self._ctx(self.vllm_config):
            self.reference.load_weights(list(load_version(hf_dir).items()))
        live = dict(self.model.named_parameters())
        ref = dict(self.reference.named_parameters())
        assert live.keys() == ref.keys(), (sorted(live), sorted(ref))
        mismatched = []
        for name, tensor in live.items():
            a = tensor.detach().contiguous().view(torch.uint8)
            b = ref[name].detach().contiguous().view(torch.uint8)
            if a.shape != b.shape or not torch.equal(a, b):
                mismatched.append(name)
        return {
            "compared": len(live),
            "mismatched": mismatched,
            "bytes": sum(t.numel() * t.element_size() for t in live.values()),
        }

    def stats(self) -> dict:
        from mx_refit.plugins import Hooks

        eng = self.engine
        hooks = Hooks()  # loads the `mx_refit` entry points, ours included
        transport = getattr(eng, "_transport", None)
        last = eng.last_update
        return {
            "registrations": transport.registrations if transport is not None else 0,
            "arenas": {
                m: (r._arena.data_ptr(), r._arena.numel())
                for m, r in eng.receivers.items()
                if r._arena is not None
            },
            "layout": eng.layout,
            "hook_layouts": (hooks.target_layout(self.model), hooks.target_layout(eng)),
            "buffers": {m: r._cycle.buffer.numel() for m, r in eng.receivers.items() if r._cycle.buffer is not None},
            "receive": None if eng.last_refit is None else (
                eng.last_refit.receive_mode, eng.last_refit.chunks, eng.last_refit.receive_memory_bytes),
            "partially_updated": eng.partially_updated,
            "last_update": None if last is None else last.to_dict(),
            "last_load": dict(eng.last_load),
            "bytes_pulled": eng.last_refit.bytes_pulled if eng.last_refit is not None else None,
            "phase_seconds": dict(eng.last_refit.phase_seconds) if eng.last_refit is not None else {},
            "param_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters()),
            "unproven": dict(eng.params.unproven) if eng.params is not None else None,
            "active": self.worker._weight_update_active,
            "session": eng._session is not None,
        }


def main() -> None:
    parser = rank_arguments()
    parser.add_argument("--hf-dir", required=True)
    args = parser.parse_args()
    opened = open_child(
        args.listen, lambda: WorkerProcess(args.rank, args.world, args.dist_init, args.hf_dir), rank=args.rank
    )
    if opened is None:
        return
    conn, proc = opened
    serve(conn, {
        "rpc": lambda arg: proc.rpc(*arg),
        "measured": lambda arg: proc.measured(*arg),
        "engine": lambda arg: getattr(proc.engine, arg[0])(**arg[1]),  # bypassing vLLM's Worker
        "check": proc.check,
        "stats": lambda _: proc.stats(),
    })
    proc.engine.shutdown()


if __name__ == "__main__":
    main()
