"""One NeMo RL Megatron policy rank (core venv: real megatron-core + Megatron-Bridge, gloo, CPU).

The rank builds a real Megatron GPT model from an HF checkpoint through Megatron-Bridge at TP=2
and wraps it in the reproduced policy worker (``_nemo_rl_contract.MegatronPolicyWorker``), whose
``checkpoint_engine_rpc`` the tests drive exactly as NeMo RL's synchronizer does.

Protocol: ``("rpc", (checkpoint_method, method_kwargs))``; ``("prepare_refit_info", None)``;
``("reset_engine", None)`` (a new job), ``("configure", options)`` (draft model, config, FP8
parameters); ``("train", hf_dir)`` loads the next weights into the same parameters in place (a training step's
effect); ``("stream_digests", None)``: digests of the export stream (every rank together);
``("stats", None)``; ``("stop", None)``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import inspect
import os
import sys
import traceback
from multiprocessing.connection import Client
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "nemo_rl_repro"))
sys.path.insert(0, str(HERE))


def digest(tensor) -> str:
    import torch

    t = tensor.detach().contiguous().cpu()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()[:24] + f"|{t.dtype}|{tuple(t.shape)}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--dist-port", type=int, required=True)
    parser.add_argument("--hf-dir", required=True)
    args = parser.parse_args()
    host, port = args.listen.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["MX_TEST_AUTHKEY"]))
    try:
        import torch
        from _harness import build_model_from_hf, init_distributed, init_model_parallel
        from _nemo_rl_contract import MegatronPolicyWorker

        init_distributed(args.rank, args.world, master_port=args.dist_port)
        init_model_parallel(tp=args.world)
        bridged = build_model_from_hf(args.hf_dir, tp=args.world)
        (chunk,) = bridged.model_chunks
        worker = MegatronPolicyWorker(rank=args.rank, model=chunk, bridge=bridged.bridge, cfg={})
        bridge_export = bridged.bridge.export_hf_weights
        export_runs = []

        def counted_export(*a, **kw):  # the real export, counted when its body starts running
            export_runs.append(1)
            yield from bridge_export(*a, **kw)

        bridged.bridge.export_hf_weights = counted_export
        addresses = {n: p.data_ptr() for n, p in chunk.named_parameters()}
    except BaseException:
        conn.send(("err", ("StartupError", traceback.format_exc())))
        return
    conn.send(("ok", {"pid": os.getpid(), "rank": args.rank}))
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            engine = getattr(worker, "checkpoint_engine", None)
            if engine is not None:
                engine.finalize()
            conn.send(("ok", None))
            break
        try:
            if cmd == "rpc":
                method, kwargs = arg
                value = asyncio.run(worker.checkpoint_engine_rpc(method, kwargs))
            elif cmd == "reset_engine":  # a new NeMo RL job on the same (expensive) Megatron model
                engine = getattr(worker, "checkpoint_engine", None)
                if engine is not None:
                    engine.finalize()
                worker.checkpoint_engine = None
                value = None
            elif cmd == "configure":  # what the worker's config says about drafts and FP8
                options = arg
                torch.manual_seed(7)
                worker.draft_model = (torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
                                      if options.get("draft") else None)
                worker.cfg = options.get("cfg") or {}
                worker.fp8_cfg = {"fp8_param": True, "fp8_recipe": "blockwise"} if options.get("fp8_param") else {}
                value = None
            elif cmd == "prepare_refit_info":
                value = {n: (tuple(s), str(d)) for n, (s, d) in worker.prepare_refit_info().items()}
            elif cmd == "train":
                from _harness import cpu_load_hf_weights

                cpu_load_hf_weights(bridged.bridge, [chunk], arg)
                moved = [n for n, p in chunk.named_parameters() if p.data_ptr() != addresses[n]]
                assert not moved, f"parameters reallocated by the load: {moved[:3]}"
                value = None
            elif cmd == "stream_digests":
                value = {name: digest(t) for name, t in worker._iter_params_with_optional_kv_scales(
                    kv_scales=arg)}
            elif cmd == "stats":
                engine = getattr(worker, "checkpoint_engine", None)
                report = getattr(engine, "last_send", None)
                transport = getattr(engine, "_transport", None)
                value = {
                    "export_runs": len(export_runs),
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
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", value))
        except BaseException as exc:
            conn.send(("err", (type(exc).__name__, f"{exc}\n{traceback.format_exc()}")))


def _is_checkpoint_engine(engine) -> bool:
    from nemo_rl.utils.checkpoint_engines.base import CheckpointEngine

    return isinstance(engine, CheckpointEngine)


if __name__ == "__main__":
    main()
