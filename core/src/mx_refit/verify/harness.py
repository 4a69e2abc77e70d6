"""Process harness for the verify tool, the demo and the tests: Megatron-Core ranks on one machine.

- CPU shims: megatron-core hard-codes a few CUDA calls that fail on machines without a GPU
  (``torch.cuda.current_device()`` in rotary embeddings and the global memory buffer, and the
  CUDA RNG tracker). ``apply_cpu_shims()`` patches exactly those, and only when CUDA is absent.
- Process groups: ``init_distributed()`` + ``init_model_parallel()`` (gloo on CPU, NCCL on GPU).
- ``launch_ranks()`` / ``rendezvous_url()``: spawn ranks and give them a rendezvous (a fresh
  ``file://`` store: nothing to bind, so no port another process can take between a probe and the
  bind, which a "free port" handed to the ranks allowed).
- ``build_model_from_hf()``: an HF checkpoint directory -> a Megatron-Core model on this rank,
  through Megatron-Bridge (``AutoBridge``), with the requested TP/PP/EP.

Everything heavy (torch, megatron) is imported inside the functions.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from mx_refit.megatron.parallel import BridgedModel

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "RankFailed",
    "apply_cpu_shims",
    "build_model_from_hf",
    "destroy_distributed",
    "init_distributed",
    "init_model_parallel",
    "launch_ranks",
    "rendezvous_url",
]

_CPU_SHIMS_APPLIED = False


def apply_cpu_shims() -> None:
    """Make megatron-core run on a machine without CUDA (idempotent; no-op when CUDA exists)."""
    global _CPU_SHIMS_APPLIED
    import torch

    if _CPU_SHIMS_APPLIED or torch.cuda.is_available():
        return
    # RotaryEmbedding.get_emb and GlobalMemoryBuffer.get_tensor call torch.cuda.current_device()
    # unconditionally; returning the CPU device keeps those tensors on the CPU.
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    _CPU_SHIMS_APPLIED = True


@contextlib.contextmanager
def _tensor_cuda_is_identity(active: bool) -> Iterator[None]:
    """While building a model on a machine without CUDA, make ``Tensor.cuda()`` a no-op.

    megatron-core moves the tied embedding to CUDA unconditionally before all-reducing it between
    the first and last pipeline stages (``LanguageModule.setup_embeddings_and_output_layer``); on
    CPU the tensor simply stays put and gloo reduces it.
    """
    if not active:
        yield
        return
    import torch

    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


def init_distributed(
    rank: int,
    world_size: int,
    *,
    init_method: str | None = None,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    device: str = "cpu",
    timeout_s: float = 300.0,
) -> None:
    """Initialise ``torch.distributed`` for one trainer rank (gloo on CPU, NCCL on GPU).

    The ranks meet at ``init_method`` (a ``rendezvous_url()`` on one machine) or at
    ``master_addr:master_port`` (a port that rank 0 binds: only for a port the job owns, e.g.
    from a launcher). Must run before Megatron-Bridge's ``provide_distributed_model``, which
    otherwise calls ``torch.cuda.set_device`` and initialises NCCL itself.
    """
    import torch
    import torch.distributed as dist

    if (init_method is None) == (master_port is None):
        raise ValueError(f"init_distributed: give exactly one of init_method ({init_method!r}) "
                         f"and master_port ({master_port!r})")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if master_port is not None:
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = "nccl"
    else:
        apply_cpu_shims()
        backend = "gloo"
    dist.init_process_group(
        backend, init_method=init_method or "env://", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def init_model_parallel(tp: int, pp: int = 1, ep: int = 1, etp: int | None = None, *, seed: int = 0) -> None:
    """``parallel_state.initialize_model_parallel`` plus an RNG tracker that works on CPU."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    else:
        # model_parallel_cuda_manual_seed needs the CUDA RNG; this tracker's fork() is a no-op.
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(seed)


def destroy_distributed() -> None:
    """Tear down Megatron's groups and the default process group (safe to call twice)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# Settings that make the bridge's providers build a model that runs (and converts) without TE/apex.
_PORTABLE_PROVIDER_SETTINGS: dict[str, Any] = {
    "bf16": False,
    "fp16": False,
    "gradient_accumulation_fusion": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "apply_rope_fusion": False,
    "persist_layer_norm": False,
    "cross_entropy_loss_fusion": False,
    "moe_grouped_gemm": False,
    "moe_permute_fusion": False,
    "moe_router_fusion": False,
    # "alltoall" creates torch.cuda.Stream(); "allgather" works everywhere.
    "moe_token_dispatcher_type": "allgather",
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
}


def build_model_from_hf(
    hf_dir: str | os.PathLike[str],
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    layer_spec: str = "local",
    pad_vocab: bool | None = None,
) -> BridgedModel:
    """Load an HF checkpoint into a Megatron-Core model on this rank through Megatron-Bridge.

    ``torch.distributed`` and Megatron's parallel state must already be initialised with the same
    ``tp``/``pp``/``ep`` (see ``init_distributed`` / ``init_model_parallel``): every rank of the
    job calls this together. ``layer_spec="local"`` uses megatron-core's local (non-TE) modules;
    ``"default"`` keeps the provider's own spec (TransformerEngine on GPU). ``pad_vocab``: pad the
    vocabulary to a multiple of ``make_vocab_size_divisible_by * tp`` as Megatron-LM trainers do;
    ``None`` pads only when the HF vocabulary does not divide by ``tp``.
    """
    import torch

    from mx_refit.megatron._bridge_import import import_bridge

    bridge_mod = import_bridge()
    dtype = dtype or torch.float32
    bridge = bridge_mod.AutoBridge.from_hf_pretrained(os.fspath(hf_dir), torch_dtype=dtype)
    provider = bridge.to_megatron_provider(load_weights=True)
    if layer_spec == "local":
        from megatron.bridge.models.gpt_provider import local_layer_spec

        provider.transformer_layer_spec = local_layer_spec
    elif layer_spec != "default":
        raise ValueError(f"layer_spec: {layer_spec!r} is not one of 'local', 'default'")
    provider.tensor_model_parallel_size = tp
    provider.pipeline_model_parallel_size = pp
    provider.expert_model_parallel_size = ep
    if etp is not None:
        provider.expert_tensor_parallel_size = etp
    if pad_vocab is None:
        pad_vocab = provider.vocab_size % tp != 0
    provider.should_pad_vocab = pad_vocab
    # Fusions off everywhere: they need apex/TE kernels, and this model is for publishing and
    # verification, not for training speed (a trainer builds its own model).
    half = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
    settings: dict[str, Any] = {"params_dtype": dtype, "pipeline_dtype": dtype, **_PORTABLE_PROVIDER_SETTINGS}
    if half is not None:
        settings[half] = True
    for key, value in settings.items():
        if hasattr(provider, key):
            setattr(provider, key, value)
    provider.finalize()
    wrapper = None
    if half is not None:
        # As Megatron trainers do: Float16Module casts every parameter (norms included, which the
        # layers create in fp32) to the half dtype, and prefixes names with "module.".
        from megatron.core.transformer.module import Float16Module

        wrapper = Float16Module
    with _tensor_cuda_is_identity(device != "cuda" and not torch.cuda.is_available()):
        model = provider.provide_distributed_model(
            wrap_with_ddp=False,
            use_cpu_initialization=device != "cuda",
            mixed_precision_wrapper=wrapper,
            fp16=half == "fp16",
            bf16=half == "bf16",
        )
    return BridgedModel(bridge=bridge, model_chunks=list(model), hf_config=bridge.hf_pretrained.config)


def rendezvous_url(folder: str | os.PathLike[str]) -> str:
    """A fresh ``file://`` rendezvous for one process group on this machine (``init_method`` of
    ``torch.distributed.init_process_group``, vLLM's ``distributed_init_method``).

    A file store binds nothing: a port probed as free and bound later by rank 0's TCPStore can be
    taken in between by any process on the machine (it was, in CI). The file goes in ``folder``
    (one the caller removes: torch does not always) under a name no other group uses.
    """
    import secrets
    from pathlib import Path

    return (Path(folder) / f"rdzv-{secrets.token_hex(8)}").resolve().as_uri()


class RankFailed(RuntimeError):
    """A spawned rank raised; the message carries its traceback."""


def _rank_entry(fn: Any, rank: int, world_size: int, init_method: str, args: tuple[Any, ...], results: Any) -> None:
    import pickle
    import traceback

    try:
        # Plain pickle (bytes) instead of the queue's ForkingPickler: torch tensors would travel
        # as shared-memory handles that die with this process.
        results.put((rank, True, pickle.dumps(fn(rank, world_size, init_method, *args))))
    except BaseException as exc:  # report everything, including SystemExit, to the parent
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise


def launch_ranks(fn: Any, world_size: int, *args: Any, timeout_s: float = 600.0) -> list[Any]:
    """Run ``fn(rank, world_size, init_method, *args)`` in ``world_size`` fresh (spawned) processes;
    ``init_method`` is their rendezvous (``init_distributed(..., init_method=init_method)``).

    ``fn`` must be importable (module-level). Returns the per-rank return values (picklable) in
    rank order; raises ``RankFailed`` with the first failing rank's traceback, or on timeout.
    """
    import multiprocessing as mp
    import tempfile

    with tempfile.TemporaryDirectory(prefix="mx-refit-ranks-") as folder:
        return _run_ranks(mp.get_context("spawn"), fn, world_size, args, rendezvous_url(folder), timeout_s)


def _run_ranks(ctx: Any, fn: Any, world_size: int, args: tuple[Any, ...], init_method: str,
               timeout_s: float) -> list[Any]:
    import pickle
    import queue
    import time

    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_entry, args=(fn, rank, world_size, init_method, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise RankFailed(f"ranks {sorted(set(range(world_size)) - set(out))} timed out "
                                     f"after {timeout_s:.0f}s") from None
                dead = [p for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)]
                if dead and results.empty():
                    raise RankFailed(f"rank process exited with code {dead[0].exitcode} without a result") from None
                continue
            if not ok:
                raise RankFailed(f"rank {rank} failed: {value}")
            out[rank] = pickle.loads(value)
    finally:
        for proc in procs:
            proc.join(timeout=10.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [out[rank] for rank in range(world_size)]
