"""FP8 on publish (``weight_sync.publish_format: fp8_block``): BF16 weights -> FP8 E4M3 with
128x128 block scales, the form vLLM's block-FP8 linear layers load and FP8 checkpoints such as
Qwen3-*-FP8 ship (``<layer>.weight`` in ``float8_e4m3fn`` plus ``<layer>.weight_scale_inv``, one
float32 per 128x128 block: ``weight ~= fp8 * scale_inv`` blockwise).

The arithmetic is vLLM's own (``vllm.utils.deep_gemm.per_block_cast_to_fp8``, which vLLM's
online block-FP8 quantisation uses): per block ``scale_inv = max(amax(|x|), 1e-4) / 448`` in
float32, ``fp8 = float8_e4m3fn(x * (1 / scale_inv))``, blocks at the tensor's edges padded with
zeros. :func:`quantize_reference` is that in plain torch (any device, the CPU reference);
:func:`quantize_into` writes into persistent buffers, on CUDA with one Triton kernel (one program
per block, IEEE-rounded division, round-to-nearest-even cast: the same bytes as the reference).

Which tensors are quantised follows vLLM: the weights of linear layers (attention qkv/o, MLP
gate/up/down, experts); embeddings, the LM head, norms, routers and biases stay in the trainer's
dtype (``hf_raw``). A sharded weight is quantised shard by shard, which equals quantising the
full tensor only when the shard's edges fall on 128-block edges: otherwise publishing refuses
clearly (as vLLM refuses a TP split that cuts a block).

Imports torch lazily (``import mx_refit`` stays light).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mx_refit.checks import PUBLISH_FORMATS
from mx_refit.errors import InvalidArgument
from mx_refit.types import PublishedTensor, Role

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from mx_refit.types import CompileCompat

__all__ = [
    "BLOCK",
    "FP8_BLOCK",
    "FP8_MAX",
    "PUBLISH_FORMATS",
    "Fp8Pair",
    "Fp8Publishing",
    "is_quantized_weight",
    "quantize_into",
    "quantize_reference",
    "scale_name",
]

BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_FLOOR = 1e-4  # vLLM's clamp of a block's amax (an all-zero block gets this scale)
FP8_BLOCK = "fp8_block"
# The compile_metadata every fp8_block tensor carries; an FP8 receiver requires this subset.
HF_MAP_KEY = "megatron.hf_map"  # the Megatron sidecar's name map (mx_refit.megatron.sidecar)
BLOCK_METADATA = {"block_size": f"{BLOCK},{BLOCK}", "fp8_dtype": "float8_e4m3fn"}

# Linear layers vLLM quantises (HF and Megatron names); everything else stays as trained.
_LINEAR = re.compile(
    r"(q_proj|k_proj|v_proj|o_proj|qkv_proj|gate_proj|up_proj|down_proj|gate_up_proj|"
    r"linear_qkv|linear_proj|linear_fc1|linear_fc2|w1|w2|w3|experts\.[^.]*)"
    r"(\.weight\d*)?$"
)
_KEPT = re.compile(r"(embed|lm_head|output_layer|norm|router|\.mlp\.gate\.|shared_expert_gate|bias)")


def scale_name(weight_name: str) -> str:
    """``x.weight`` -> ``x.weight_scale_inv`` (the checkpoint name vLLM loads); a Megatron
    grouped expert ``x.weight7`` -> ``x_scale_inv.weight7`` (keeps the expert id last, where the
    planner parses it; its HF names come from the sidecar's name map)."""
    if weight_name.endswith(".weight"):
        return f"{weight_name.removesuffix('.weight')}.weight_scale_inv"
    stem, sep, expert = weight_name.rpartition(".weight")
    if sep and expert.isdigit():
        return f"{stem}_scale_inv.weight{expert}"
    return f"{weight_name}.weight_scale_inv"


def is_quantized_weight(name: str, ndim: int, dtype_name: str) -> bool:
    """Whether vLLM's block-FP8 would quantise this tensor: a 2-D floating weight of a linear
    layer (not an embedding, LM head, norm, router or bias)."""
    if ndim != 2 or dtype_name not in ("bfloat16", "float16", "float32"):
        return False
    stem = name.removesuffix(".weight")
    return bool(_LINEAR.search(name) or _LINEAR.search(stem)) and not _KEPT.search(name)


def quantize_reference(x: "torch.Tensor") -> "tuple[torch.Tensor, torch.Tensor]":
    """vLLM's per-block FP8 cast of a 2-D tensor (on its own device): ``(fp8, scale_inv)``."""
    import torch

    if x.dim() != 2:
        raise InvalidArgument(f"quantize_reference: expected a 2-D tensor, got shape {tuple(x.shape)}")
    m, n = x.shape
    padded = torch.zeros((_ceil(m) * BLOCK, _ceil(n) * BLOCK), dtype=x.dtype, device=x.device)
    padded[:m, :n] = x
    view = padded.view(-1, BLOCK, padded.size(1) // BLOCK, BLOCK)
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(SCALE_FLOOR)
    # A true division on every device: on CUDA, torch turns a division by a Python scalar into
    # a multiplication by its rounded reciprocal (1 ulp off for some blocks), so `amax / 448`
    # gave other bytes there than on the CPU (measured on the H200: 659 of 1024 scales).
    scale = torch.div(amax, torch.full_like(amax, FP8_MAX))
    q = (view * torch.reciprocal(scale)).to(torch.float8_e4m3fn)
    return q.view_as(padded)[:m, :n].contiguous(), scale.view(view.size(0), view.size(2))


def _ceil(n: int) -> int:
    return -(-n // BLOCK)


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    return (_ceil(shape[0]), _ceil(shape[1]))


def quantize_into(x: "torch.Tensor", q: "torch.Tensor", scale: "torch.Tensor") -> None:
    """Quantise ``x`` into the persistent ``q`` (fp8, same shape) and ``scale`` (float32 grid),
    on ``x``'s device: one Triton kernel on CUDA (when Triton is there), the reference otherwise."""
    if x.is_cuda and x.is_contiguous() and _kernel_verified():
        _launch(x, q, scale)
        return
    ref_q, ref_s = quantize_reference(x)
    q.copy_(ref_q)
    scale.copy_(ref_s)


_KERNEL: list[object] = []


def _triton_kernel() -> object | None:
    if not _KERNEL:
        try:
            from mx_refit._fp8_triton import block_quant_kernel
        except ImportError:
            _KERNEL.append(None)
        else:
            _KERNEL.append(block_quant_kernel)
    return _KERNEL[0]


_VERIFIED: list[bool] = []


def _kernel_verified() -> bool:
    """Whether the Triton kernel loaded and, on a probe tensor, wrote the reference's exact bytes
    (checked once per process; a mismatch logs and falls back to the reference, never ships
    other bytes)."""
    if not _VERIFIED:
        ok = _triton_kernel() is not None
        if ok:
            import logging

            import torch

            g = torch.Generator(device="cuda").manual_seed(0)
            probe = (torch.randn(300, 400, generator=g, device="cuda") * 3).to(torch.bfloat16)
            probe[:128, :128] = 0
            q = torch.empty(probe.shape, dtype=torch.float8_e4m3fn, device="cuda")
            s = torch.empty(scale_shape(tuple(probe.shape)), dtype=torch.float32, device="cuda")
            _launch(probe, q, s)
            ref_q, ref_s = quantize_reference(probe)
            ok = torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
            if not ok:
                logging.getLogger(__name__).warning("the Triton FP8 kernel's bytes differ from the reference; using torch ops")
        _VERIFIED.append(ok)
    return _VERIFIED[0]


def _launch(x: "torch.Tensor", q: "torch.Tensor", scale: "torch.Tensor") -> None:
    m, n = x.shape
    grid = (_ceil(m), _ceil(n))
    kernel = _triton_kernel()
    kernel[grid](x, q, scale, m, n, x.stride(0), q.stride(0), scale.stride(0),  # type: ignore[index]
                 BLOCK=BLOCK, FP8_MAX=FP8_MAX, FLOOR=SCALE_FLOOR)


def check_block_aligned(published: PublishedTensor, shape: tuple[int, ...]) -> None:
    """Refuse a shard whose edges cut a 128 block (its scales would differ from the full
    tensor's): names the tensor, the axis, the offset and the extent."""
    axis = published.shard_axis
    full = published.global_shape or shape
    start = published.shard_offset
    end = start + shape[axis] if axis >= 0 else 0
    if published.role in (Role.GATED_MLP_COLUMN, Role.EXPERT_COLUMN) and (shape[0] % 2 or (shape[0] // 2) % BLOCK):
        raise InvalidArgument(
            f"tensors[{published.name!r}]: its [gate; up] halves of {shape[0] // 2} rows cut a {BLOCK}x{BLOCK} FP8 "
            f"block; publish_format {FP8_BLOCK!r} needs each half on a multiple of {BLOCK} (publish bf16)"
        )
    if axis < 0:
        return
    if start % BLOCK or (end % BLOCK and end != full[axis]):
        raise InvalidArgument(
            f"tensors[{published.name!r}]: shard [{start}, {end}) of dim {axis} (of {full[axis]}) cuts a "
            f"{BLOCK}x{BLOCK} FP8 block; publish_format {FP8_BLOCK!r} needs every shard edge on a multiple "
            f"of {BLOCK} (change the trainer's TP size, or publish bf16)"
        )


@dataclass
class Fp8Pair:
    """One quantised weight: its BF16 source and the persistent FP8 and scale buffers."""

    source: PublishedTensor
    q: "torch.Tensor"
    scale: "torch.Tensor"

    @classmethod
    def allocate(cls, published: PublishedTensor) -> "Fp8Pair":
        import torch

        x = published.tensor
        check_block_aligned(published, tuple(x.shape))
        q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        scale = torch.empty(scale_shape(tuple(x.shape)), dtype=torch.float32, device=x.device)
        return cls(published, q, scale)

    def matches(self, published: PublishedTensor) -> bool:
        x, src = published.tensor, self.source.tensor
        return (x.data_ptr() == src.data_ptr() and x.shape == src.shape and x.dtype == src.dtype
                and (published.shard_axis, published.shard_offset, published.global_shape, published.role)
                == (self.source.shard_axis, self.source.shard_offset, self.source.global_shape, self.source.role))

    def published(self) -> tuple[PublishedTensor, PublishedTensor]:
        """The FP8 weight and its scale grid as published tensors (same role and shard axis;
        offsets and shapes of the grid in blocks)."""
        src = self.source
        full = tuple(src.global_shape) if src.global_shape is not None else tuple(src.tensor.shape)
        weight_meta = {**BLOCK_METADATA, "scale": scale_name(src.name)}
        scale_meta = {**BLOCK_METADATA, "scale_of": src.name, "weight_shape": ",".join(map(str, full))}
        weight = PublishedTensor(src.name, self.q, src.role, full, src.shard_axis, src.shard_offset, dict(src.extras),
                                 compile_target=FP8_BLOCK, compile_metadata=weight_meta)
        grid_offset = src.shard_offset // BLOCK if src.shard_axis >= 0 else 0
        grid = PublishedTensor(scale_name(src.name), self.scale, src.role, scale_shape(full), src.shard_axis,
                               grid_offset, dict(src.extras), compile_target=FP8_BLOCK, compile_metadata=scale_meta)
        return weight, grid


def wire_ratio(shape: tuple[int, int]) -> float:
    """Bytes of (fp8 + scales) over bytes of bf16 for one weight."""
    fp8 = math.prod(shape) + 4 * math.prod(scale_shape(shape))
    return fp8 / (2 * math.prod(shape))


class Fp8Publishing:
    """A publisher's FP8 buffers, allocated on first use and reused every version (so they are
    registered with the transport once): :meth:`convert` quantises the eligible weights into
    them and returns what to publish instead (everything else unchanged)."""

    def __init__(self) -> None:
        self._pairs: dict[str, Fp8Pair] = {}
        self.seconds = 0.0  # the last convert's wall time (device work included)
        self.bytes_in = 0  # BF16 bytes quantised by the last convert

    def convert(self, tensors: "list[PublishedTensor] | tuple[PublishedTensor, ...]") -> list[PublishedTensor]:
        import time

        import torch

        start = time.perf_counter()
        out: list[PublishedTensor] = []
        devices = set()
        bytes_in = 0
        for published in tensors:
            x = published.tensor
            if published.compile_target != "hf_raw" or not is_quantized_weight(
                published.name, x.dim(), str(x.dtype).removeprefix("torch.")
            ):
                out.append(published)
                continue
            pair = self._pairs.get(published.name)
            if pair is None or not pair.matches(published):
                pair = self._pairs[published.name] = Fp8Pair.allocate(published)
            quantize_into(x, pair.q, pair.scale)
            out.extend(pair.published())
            bytes_in += x.numel() * x.element_size()
            if x.is_cuda:
                devices.add(x.device)
        for device in devices:  # the bytes must be final before mark_ready
            torch.cuda.synchronize(device)
        self.seconds = time.perf_counter() - start
        self.bytes_in = bytes_in
        return out

    def extend_sidecar(self, sidecar: dict[str, Any]) -> None:
        """Give every quantised weight's scale grid a name-map entry next to the weight's
        (Megatron sidecars: ``megatron.hf_map``), so planners map it to the HF scale names."""
        hf_map = sidecar.get(HF_MAP_KEY)
        if not isinstance(hf_map, dict):
            return
        extended = dict(hf_map)
        for name in self._pairs:
            entry = hf_map.get(name)
            if isinstance(entry, dict) and isinstance(entry.get("hf"), list):
                extended[scale_name(name)] = {**entry, "hf": [scale_name(h) for h in entry["hf"]]}
        sidecar[HF_MAP_KEY] = extended

    def compat(self) -> "CompileCompat":
        """What the FP8 bytes depend on: the arithmetic (block size, rounding, vLLM's formula),
        not the torch, GPU, CUDA or Triton build (the kernel's bytes equal the reference's), so
        those are left unstated (they match any receiver's)."""
        import hashlib

        from mx_refit.types import CompileCompat

        config = ",".join(f"{k}={v}" for k, v in sorted(BLOCK_METADATA.items()))
        digest = hashlib.blake2b(f"fp8_block;{config};floor={SCALE_FLOOR}".encode(), digest_size=8).hexdigest()
        return CompileCompat(framework="mx-refit", compile_config_digest=f"fp8_block:{digest}")
