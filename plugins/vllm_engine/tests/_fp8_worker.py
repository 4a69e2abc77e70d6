"""One TP rank of a block-FP8 vLLM model on the CPU, for the FP8 load test (issue 23).

vLLM's own ``Qwen2ForCausalLM`` is built by ``initialize_model`` from a checkpoint whose
``config.json`` carries a block-FP8 ``quantization_config`` (``Fp8Config``, blocks [128, 128]):
its linear layers get vLLM's FP8 ``weight`` and ``weight_scale_inv`` parameters and weight
loaders. One thing is skipped: ``Fp8LinearMethod.create_weights`` ends by choosing a GEMM
kernel, and vLLM 0.33's only CPU block-FP8 kernels need AMX (Sapphire Rapids or newer), which
this CPU lacks. The kernel is used by ``forward`` and ``process_weights_after_loading``, neither
of which runs here; the parameters, their shapes and dtypes, and every weight loader are vLLM's.

Two models per rank: ``reference`` loads the FP8 checkpoint written by the reference quantiser;
``model`` receives the same weights through mx-refit (a real :class:`~mx_refit.Receiver`, with
the vLLM plugin's target layout for this quantisation) and hands them to the same
``load_weights``. ``compare`` reports every parameter that differs, byte for byte.

Protocol: see :mod:`mx_refit.testing.procs` (``serve``).
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from mx_refit.testing.procs import open_child, rank_arguments, serve  # noqa: E402  (after the platform is chosen)


def _without_gemm_kernel() -> None:
    """Let ``Fp8LinearMethod.create_weights`` finish without a GEMM kernel (see the module doc)."""
    from vllm.model_executor.layers.quantization import fp8

    fp8.init_fp8_linear_kernel = lambda **_: None  # type: ignore[assignment]


class Fp8Worker:
    def __init__(self, rank: int, world: int, dist_init: str, hf_dir: str) -> None:
        from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.model_executor.model_loader.utils import initialize_model

        from mx_refit.testing.checkpoints import load_version

        _without_gemm_kernel()
        self.vllm_config = VllmConfig(
            model_config=ModelConfig(
                model=hf_dir, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True
            ),
            parallel_config=ParallelConfig(tensor_parallel_size=world),
            device_config=DeviceConfig(device="cpu"),
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
            self.reference = initialize_model(vllm_config=self.vllm_config)
            self.reference.load_weights(list(load_version(hf_dir).items()))
            self.model = initialize_model(vllm_config=self.vllm_config, prefix="refit")

    def describe(self, _: object) -> dict:
        """The quantisation vLLM built and the FP8 parameters it holds (to prove the test is FP8)."""
        quant = self.vllm_config.quant_config
        return {
            "quant_config": type(quant).__name__,
            "block": list(getattr(quant, "weight_block_size", None) or []),
            "dtypes": {n: str(p.dtype) for n, p in self.model.named_parameters()},
            "shapes": {n: tuple(p.shape) for n, p in self.model.named_parameters()},
        }

    def refit(self, arg: tuple[str, str, int]) -> dict:
        """Pull ``version`` of ``model_name`` with this engine's target layout, load it."""
        from mx_refit import Receiver
        from mx_refit_vllm.layout import target_layout

        catalog, model_name, version = arg
        layout = target_layout(self.vllm_config.parallel_config, self.vllm_config.quant_config)
        with Receiver(catalog, model_name, target=layout) as receiver:
            got = receiver.refit(version)
            tensors = list(got.tensors)
        with self._ctx(self.vllm_config):
            self.model.load_weights(tensors)
        return {
            "targets": list(layout.compile_targets),
            "received": {n: (str(t.dtype), tuple(t.shape)) for n, t in tensors},
        }

    def compare(self, _: object) -> dict:
        import torch

        live = dict(self.model.named_parameters())
        ref = dict(self.reference.named_parameters())
        assert live.keys() == ref.keys(), (sorted(live), sorted(ref))
        mismatched = []
        for name, tensor in live.items():
            a, b = tensor.detach(), ref[name].detach()
            same = a.shape == b.shape and a.dtype == b.dtype
            if not same or not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
                mismatched.append(name)
        scalars = {n: float(p) for n, p in live.items() if p.dim() == 0}
        return {"compared": len(live), "mismatched": mismatched, "scalars": scalars}


def main() -> None:
    parser = rank_arguments()
    parser.add_argument("--hf-dir", required=True)
    args = parser.parse_args()
    opened = open_child(
        args.listen, lambda: Fp8Worker(args.rank, args.world, args.dist_init, args.hf_dir), rank=args.rank
    )
    if opened is None:
        return
    conn, proc = opened
    serve(conn, {"describe": proc.describe, "refit": proc.refit, "compare": proc.compare})


if __name__ == "__main__":
    main()
