"""A vLLM worker rank whose Worker class gets a worker extension through vLLM's real
``WorkerWrapperBase.init_worker`` (its name-clash check and ``__bases__`` injection).

Built on the vLLM plugin's ``_vllm_worker.WorkerProcess`` (real Qwen2, real ``mx`` engine): the
wrapper is given ``worker_cls`` = :class:`BareWorker` (vLLM's GPU ``Worker`` minus its device
set-up, which needs an accelerator) and ``worker_extension_cls`` = the class under test, then
the resulting worker takes over the state ``WorkerProcess`` built. ``--no-engine`` drops the
worker's own weight-transfer engine, as a worker started without ``--weight-transfer-config``
has none, so the extension must build its own.

Same protocol as ``_vllm_worker.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent.parent / "vllm_engine" / "tests")]

import _vllm_worker  # noqa: E402
from vllm.v1.worker.gpu_worker import Worker  # noqa: E402

from mx_refit.testing.procs import open_child, rank_arguments, serve  # noqa: E402


class BareWorker(Worker):
    """vLLM's Worker with every method, but a constructor that only records its arguments."""

    def __init__(self, **kwargs) -> None:  # noqa: D107 - see the class docstring
        self.init_kwargs = kwargs


class ExtendedWorkerProcess(_vllm_worker.WorkerProcess):
    def __init__(self, rank: int, world: int, dist_init: str, hf_dir: str, extension: str, engine: bool) -> None:
        import torch
        from vllm.v1.worker.worker_base import WorkerWrapperBase

        super().__init__(rank, world, dist_init, hf_dir)
        parallel = self.vllm_config.parallel_config
        parallel.worker_cls = f"{__name__}.BareWorker" if __name__ != "__main__" else "_ext_worker.BareWorker"
        parallel.worker_extension_cls = extension
        wrapper = WorkerWrapperBase(rpc_rank=0)
        wrapper.init_worker([{"vllm_config": self.vllm_config}])
        worker = wrapper.worker
        state = dict(vars(self.worker))
        runner = state["model_runner"]
        model = self.model
        runner.get_model = lambda: model
        worker.__dict__.update(state)
        worker.device = torch.device("cpu")
        if not engine:
            self.engine.shutdown()
            worker.weight_transfer_engine = None
        self.worker = worker
        self.extension_bases = [c.__qualname__ for c in type(worker).__mro__]

    def stats(self) -> dict:
        own = getattr(self.worker, "_mx_refit_own_engine", None)
        if own is not None:
            self.engine = own  # report the engine the extension actually used
        out = super().stats()
        out["mro"] = self.extension_bases
        out["own_engine"] = own is not None
        return out


def main() -> None:
    parser = rank_arguments()
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--extension", required=True)
    parser.add_argument("--no-engine", action="store_true")
    args = parser.parse_args()
    opened = open_child(args.listen, lambda: ExtendedWorkerProcess(
        args.rank, args.world, args.dist_init, args.hf_dir, args.extension, not args.no_engine
    ), rank=args.rank)
    if opened is None:
        return
    conn, proc = opened
    serve(conn, {"rpc": lambda arg: proc.rpc(*arg), "check": proc.check, "stats": lambda _: proc.stats()})
    proc.engine.shutdown()


if __name__ == "__main__":
    main()
