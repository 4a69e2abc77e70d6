"""One NeMo RL Megatron policy rank (core venv: real megatron-core + Megatron-Bridge, gloo, CPU).

The rank builds a real Megatron GPT model from an HF checkpoint through Megatron-Bridge at TP=2
(TP = the world; ``--ep``/``--etp`` for a MoE checkpoint's expert mesh) and wraps it in the
reproduced policy worker (``_nemo_rl_contract.MegatronPolicyWorker``), whose
``checkpoint_engine_rpc`` the tests drive exactly as NeMo RL's synchronizer does.

Protocol: ``("rpc", (checkpoint_method, method_kwargs))``; ``("prepare_refit_info", None)``;
``("reset_engine", None)`` (a new job), ``("configure", options)`` (draft model, config, FP8
parameters); ``("train", hf_dir)`` loads the next weights into the same parameters in place (a training step's
effect); ``("stream_digests", None)``: digests of the export stream (every rank together);
``("stats", None)``; ``("stop", None)``.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "nemo_rl_repro"))
sys.path.insert(0, str(HERE))

from mx_refit.testing.checkpoints import tensor_digest as digest  # noqa: E402
from mx_refit.testing.procs import open_child, rank_arguments, serve  # noqa: E402


class PolicyRank:
    """A TP rank's process group, Megatron model (through Megatron-Bridge) and policy worker."""

    def __init__(self, rank: int, world: int, dist_init: str, hf_dir: str, ep: int = 1, etp: int | None = None) -> None:
        from _harness import build_model_from_hf, init_distributed, init_model_parallel
        from _nemo_rl_contract import MegatronPolicyWorker

        init_distributed(rank, world, init_method=dist_init)
        init_model_parallel(tp=world, ep=ep, etp=etp)
        self.bridged = build_model_from_hf(hf_dir, tp=world, ep=ep, etp=etp)
        (self.chunk,) = self.bridged.model_chunks
        self.worker = MegatronPolicyWorker(rank=rank, model=self.chunk, bridge=self.bridged.bridge, cfg={})
        self.worker.new_mapping_type = False
        build_tasks = self.worker._build_refit_conversion_tasks

        def tasks_of_a_new_architecture():
            # A model bridge of a new architecture registers its own mapping class, as Bridge
            # 0.7's Qwen3-Next (GDN, QKVG) and Nemotron-H (Mamba) do. Here: a real QKVMapping
            # subclass, so the export (the fallback's stream) stays byte-identical.
            tasks = build_tasks()
            return [_as_new_mapping_type(t) for t in tasks] if self.worker.new_mapping_type else tasks

        self.worker._build_refit_conversion_tasks = tasks_of_a_new_architecture
        bridge_export = self.bridged.bridge.export_hf_weights
        self.export_runs: list[int] = []

        def counted_export(*a, **kw):  # the real export, counted when its body starts running
            self.export_runs.append(1)
            yield from bridge_export(*a, **kw)

        self.bridged.bridge.export_hf_weights = counted_export
        self.addresses = {n: p.data_ptr() for n, p in self.chunk.named_parameters()}

    def rpc(self, method: str, kwargs: dict) -> object:
        return asyncio.run(self.worker.checkpoint_engine_rpc(method, kwargs))

    def finalize_engine(self) -> None:
        engine = getattr(self.worker, "checkpoint_engine", None)
        if engine is not None:
            engine.finalize()

    def reset_engine(self) -> None:
        """A new NeMo RL job on the same (expensive) Megatron model."""
        self.finalize_engine()
        self.worker.checkpoint_engine = None

    def configure(self, options: dict) -> None:
        """What the worker's config says about drafts and FP8."""
        import torch

        worker = self.worker
        torch.manual_seed(7)
        worker.draft_model = (torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
                              if options.get("draft") else None)
        worker.cfg = options.get("cfg") or {}
        worker.fp8_cfg = {"fp8_param": True, "fp8_recipe": "blockwise"} if options.get("fp8_param") else {}
        worker.refit_conversion_tasks = None  # rebuilt by the next prepare_refit_info
        worker.new_mapping_type = bool(options.get("new_mapping_type"))

    def prepare_refit_info(self) -> dict:
        return {n: (tuple(s), str(d)) for n, (s, d) in self.worker.prepare_refit_info().items()}

    def train(self, hf_dir: str) -> None:
        from _harness import cpu_load_hf_weights

        cpu_load_hf_weights(self.bridged.bridge, [self.chunk], hf_dir)
        moved = [n for n, p in self.chunk.named_parameters() if p.data_ptr() != self.addresses[n]]
        assert not moved, f"parameters reallocated by the load: {moved[:3]}"

    def stream_digests(self, kv_scales: object) -> dict:
        return {name: digest(t) for name, t in self.worker._iter_params_with_optional_kv_scales(kv_scales=kv_scales)}

    def stats(self) -> dict:
        worker = self.worker
        engine = getattr(worker, "checkpoint_engine", None)
        report = getattr(engine, "last_send", None)
        transport = getattr(engine, "_transport", None)
        return {
            "export_runs": len(self.export_runs),
            "export_calls": worker.export_calls,
            "generator_states": [inspect.getgeneratorstate(g) for g in worker.generators],
            "last_send": None if report is None else vars(report),
            "registrations": None if transport is None else transport.registrations,
            "engine_type": None if engine is None else f"{type(engine).__module__}.{type(engine).__name__}",
            "engine_is_checkpoint_engine": _is_checkpoint_engine(engine),
            "owner_is_worker": engine is not None and engine.policy_worker is worker,
            "version": None if engine is None else engine.version,
            "catalog": None if engine is None else engine._address,
        }


def main() -> None:
    parser = rank_arguments()
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--etp", type=int, default=None)
    args = parser.parse_args()
    opened = open_child(
        args.listen, lambda: PolicyRank(args.rank, args.world, args.dist_init, args.hf_dir, args.ep, args.etp),
        rank=args.rank,
    )
    if opened is None:
        return
    conn, rank = opened
    serve(conn, {
        "rpc": lambda arg: rank.rpc(*arg),
        "reset_engine": lambda _: rank.reset_engine(),
        "configure": rank.configure,
        "prepare_refit_info": lambda _: rank.prepare_refit_info(),
        "train": rank.train,
        "stream_digests": rank.stream_digests,
        "stats": lambda _: rank.stats(),
    }, on_stop=rank.finalize_engine)


def _as_new_mapping_type(task):
    import dataclasses

    from megatron.bridge.models.conversion.param_mapping import QKVMapping

    class NewArchQKVMapping(QKVMapping):
        pass

    if type(task.mapping) is not QKVMapping:
        return task
    mapping = QKVMapping.__new__(NewArchQKVMapping)
    mapping.__dict__.update(task.mapping.__dict__)
    return dataclasses.replace(task, mapping=mapping)


def _is_checkpoint_engine(engine) -> bool:
    from nemo_rl.utils.checkpoint_engines.base import CheckpointEngine

    return isinstance(engine, CheckpointEngine)


if __name__ == "__main__":
    main()
