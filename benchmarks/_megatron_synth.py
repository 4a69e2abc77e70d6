"""A synthetic Megatron-shaped model for refit benchmarks: its HF export, its native shards, and
what each vLLM-style receiver must end up holding.

Three pieces of pure math, kept apart from the planner so that a planner bug shows up as a
mismatch instead of being mirrored:

* **The HF export.** Every HF tensor's bytes are a pure function of ``(name, version, element
  index)`` (an integer hash turned into finite bf16 values), so any block of any tensor can be
  generated on any device without materialising the rest, and a receiver can regenerate exactly
  the window it holds on its own GPU (nothing is shipped to check against).
* **The Megatron layout** a Megatron-Core trainer (through Megatron-Bridge and the mx-refit
  collector) publishes: fused group-interleaved QKV (``[q heads of group g | k_g | v_g]`` per
  query group, Bridge ``merge_qkv_weights``), per-rank ``[gate_t; up_t]`` fused MLP and expert
  fc1 (Bridge ``GatedMLPMapping``), row-parallel ``linear_proj``/``linear_fc2`` split on dim 1,
  vocabulary padded to a multiple of ``128 * TP`` rows, TE grouped-GEMM expert names
  (``…experts.linear_fc1.weight<E>``) with global expert ids, descriptors with the collector's
  geometry (``shard_axis`` from the role even at TP=1, ``tp_rank``/``tp_size``/``expert_id`` extras).
  Each rank's shard is generated straight from HF coordinates (no global tensor, no gather).
* **The receiver windows** (vLLM's tensor-parallel conventions, restated independently):
  q/k/v/gate/up and vocabulary rows on dim 0 (KV heads replicated when there are fewer than
  ranks, vocabulary padded to 64 and clipped), o_proj/down_proj columns on dim 1, norms and the
  router whole; with target EP > 1 a worker holds only its own experts, whole.

The model has ``dense_layers`` dense GQA layers followed by ``moe_layers`` GQA layers with a
routed MoE block (DeepSeek/Qwen-MoE style "first k dense"). No torch import at module level.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from mx_refit.types import PublishedTensor, Role, TargetLayout

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "CheckReport",
    "MegatronParam",
    "ModelShape",
    "Shard",
    "TrainerLayout",
    "Window",
    "check_received",
    "expected_windows",
    "fill_hf_block",
    "hf_shapes",
    "megatron_params",
    "rank_buffer",
    "sidecar",
    "window_bytes",
    "write_shard",
]

ELEMENT_BYTES = 2  # bf16
_MASK31 = 0x7FFFFFFF
_CHUNK_ELEMENTS = 1 << 25  # elements hashed at once: bounds int64 temporaries to ~256 MiB
# Megatron's DDP buffer pads each parameter's start to 64 elements (distributed optimizer).
_DDP_ALIGN_ELEMENTS = 64
MEGATRON_VOCAB_DIVISIBLE = 128  # make_vocab_size_divisible_by; padded to this times TP
VLLM_VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


# --------------------------------------------------------------------------------------------
# Geometry
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """Transformer geometry. Defaults (scale 1.0): 16 GQA layers (4 dense, 12 with 64 experts),
    about 22.7 GiB of bf16 HF tensors."""

    dense_layers: int = 4
    moe_layers: int = 12
    heads: int = 32
    groups: int = 8
    head_dim: int = 128
    ffn: int = 12288
    experts: int = 64
    moe_ffn: int = 1024
    vocab: int = 151_665  # not a multiple of 64: exercises Megatron padding and vLLM clipping

    @classmethod
    def scaled(cls, scale: float, **overrides: int) -> "ModelShape":
        """The default shape with every width times ``sqrt(scale)`` (so bytes scale ~linearly),
        rounded to sizes every TP up to 8 divides; layer and expert counts stay unless
        overridden."""
        if scale <= 0:
            raise ValueError(f"--scale must be > 0, got {scale}")
        base = cls()
        f = math.sqrt(scale)

        def width(value: int, multiple: int) -> int:
            return max(multiple, round(value * f / multiple) * multiple)

        shape = replace(
            base,
            head_dim=width(base.head_dim, 8),
            ffn=width(base.ffn, 64),
            moe_ffn=width(base.moe_ffn, 16),
            vocab=max(257, round(base.vocab * f)) | 1,  # odd: never a multiple of the padding
        )
        return replace(shape, **overrides)

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    @property
    def layers(self) -> int:
        return self.dense_layers + self.moe_layers

    def is_moe(self, layer: int) -> bool:
        return layer >= self.dense_layers

    def validate(self, *tp_sizes: int) -> None:
        """Reject shapes some TP size in ``tp_sizes`` cannot split the way Megatron and vLLM do."""
        if self.heads % self.groups:
            raise ValueError(f"heads={self.heads} must be a multiple of groups={self.groups}")
        if self.moe_layers and self.experts < 1:
            raise ValueError("MoE layers need experts >= 1")
        for tp in tp_sizes:
            for what, extent in (("heads", self.heads), ("ffn", self.ffn), ("moe_ffn", self.moe_ffn)):
                if extent % tp:
                    raise ValueError(f"{what}={extent} does not divide by TP size {tp}")
            if self.groups % tp and tp % self.groups:
                raise ValueError(f"groups={self.groups} and TP size {tp}: neither divides the other")

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "hidden": self.hidden}


@dataclass(frozen=True)
class TrainerLayout:
    """The publishing job: ``tp`` x ``ep`` ranks (Megatron order: TP fastest), expert-TP ``etp``.

    Dense parameters are TP-split and replicated over EP ranks; EP rank ``e`` owns experts
    ``[e * E / ep, (e + 1) * E / ep)``, split over ``etp`` of its TP ranks (Megatron's default
    ``expert_tensor_parallel_size`` is the TP size).
    """

    tp: int = 1
    ep: int = 1
    etp: int = 1

    @classmethod
    def parse(cls, text: str, expert_tp: int | None = None) -> "TrainerLayout":
        match = re.fullmatch(r"tp(\d+)(?:ep(\d+))?", text)
        if not match:
            raise ValueError(f"--trainer-layout: expected tpN or tpNepM, got {text!r}")
        tp, ep = int(match.group(1)), int(match.group(2) or 1)
        etp = tp if expert_tp is None else expert_tp
        if tp < 1 or ep < 1 or etp < 1 or tp % etp:
            raise ValueError(f"--trainer-layout {text!r} with expert TP {etp}: sizes must be >= 1, ETP | TP")
        return cls(tp, ep, etp)

    @property
    def ranks(self) -> int:
        return self.tp * self.ep

    def position(self, rank: int) -> tuple[int, int]:
        """``(tp_rank, ep_rank)`` of global rank ``rank``."""
        return rank % self.tp, rank // self.tp

    def padded_vocab(self, vocab: int) -> int:
        step = MEGATRON_VOCAB_DIVISIBLE * self.tp
        return -(-vocab // step) * step

    def __str__(self) -> str:
        return f"tp{self.tp}" + (f"ep{self.ep}" if self.ep > 1 else "") + (
            f"(etp{self.etp})" if self.etp != self.tp else "")


def hf_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every HF tensor (Qwen/Llama naming) and its shape, in checkpoint order."""
    h, d = shape.hidden, shape.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab, h)}
    for layer in range(shape.layers):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (shape.heads * d, h)
        out[p + "self_attn.k_proj.weight"] = (shape.groups * d, h)
        out[p + "self_attn.v_proj.weight"] = (shape.groups * d, h)
        out[p + "self_attn.o_proj.weight"] = (h, shape.heads * d)
        out[p + "post_attention_layernorm.weight"] = (h,)
        if shape.is_moe(layer):
            out[p + "mlp.gate.weight"] = (shape.experts, h)
            for e in range(shape.experts):
                out[p + f"mlp.experts.{e}.gate_proj.weight"] = (shape.moe_ffn, h)
                out[p + f"mlp.experts.{e}.up_proj.weight"] = (shape.moe_ffn, h)
                out[p + f"mlp.experts.{e}.down_proj.weight"] = (h, shape.moe_ffn)
        else:
            out[p + "mlp.gate_proj.weight"] = (shape.ffn, h)
            out[p + "mlp.up_proj.weight"] = (shape.ffn, h)
            out[p + "mlp.down_proj.weight"] = (h, shape.ffn)
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (shape.vocab, h)
    return out


def model_bytes(shape: ModelShape) -> int:
    """Bytes of the whole HF export (what a full-model broadcast moves)."""
    return sum(math.prod(s) for s in hf_shapes(shape).values()) * ELEMENT_BYTES


class MegatronParam(NamedTuple):
    """One Megatron parameter (global, in Megatron concat coordinates) and its HF sources."""

    name: str
    role: Role
    hf: tuple[str, ...]
    mapping: str  # Megatron-Bridge mapping class name, as the sidecar records it
    global_shape: tuple[int, ...]
    split: int  # how many ranks split it (TP, expert TP, or 1 for replicated)
    expert: int | None = None


def megatron_params(shape: ModelShape, layout: TrainerLayout) -> list[MegatronParam]:
    """Every Megatron parameter of the model under ``layout`` (all ranks, all experts)."""
    h, d, tp, etp = shape.hidden, shape.head_dim, layout.tp, layout.etp
    pv = layout.padded_vocab(shape.vocab)
    out = [MegatronParam("embedding.word_embeddings.weight", Role.VOCAB_PARALLEL,
                         ("model.embed_tokens.weight",), "AutoMapping", (pv, h), tp)]
    for layer in range(shape.layers):
        m, p = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        out.append(MegatronParam(m + "self_attention.linear_qkv.layer_norm_weight", Role.REPLICATED,
                                 (p + "input_layernorm.weight",), "AutoMapping", (h,), 1))
        out.append(MegatronParam(m + "self_attention.linear_qkv.weight", Role.QKV_COLUMN,
                                 tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv"), "QKVMapping",
                                 ((shape.heads + 2 * shape.groups) * d, h), tp))
        out.append(MegatronParam(m + "self_attention.linear_proj.weight", Role.ROW,
                                 (p + "self_attn.o_proj.weight",), "AutoMapping", (h, shape.heads * d), tp))
        if shape.is_moe(layer):
            out.append(MegatronParam(m + "pre_mlp_layernorm.weight", Role.REPLICATED,
                                     (p + "post_attention_layernorm.weight",), "AutoMapping", (h,), 1))
            out.append(MegatronParam(m + "mlp.router.weight", Role.REPLICATED, (p + "mlp.gate.weight",),
                                     "AutoMapping", (shape.experts, h), 1))
            # TEGroupedMLP registers linear_fc1.weight0..N, then linear_fc2.weight0..N: that order.
            for e in range(shape.experts):
                x = f"{p}mlp.experts.{e}."
                out.append(MegatronParam(f"{m}mlp.experts.linear_fc1.weight{e}", Role.EXPERT_COLUMN,
                                         (x + "gate_proj.weight", x + "up_proj.weight"), "GatedMLPMapping",
                                         (2 * shape.moe_ffn, h), etp, e))
            for e in range(shape.experts):
                out.append(MegatronParam(f"{m}mlp.experts.linear_fc2.weight{e}", Role.EXPERT_ROW,
                                         (f"{p}mlp.experts.{e}.down_proj.weight",), "AutoMapping",
                                         (h, shape.moe_ffn), etp, e))
        else:
            out.append(MegatronParam(m + "mlp.linear_fc1.layer_norm_weight", Role.REPLICATED,
                                     (p + "post_attention_layernorm.weight",), "AutoMapping", (h,), 1))
            out.append(MegatronParam(m + "mlp.linear_fc1.weight", Role.GATED_MLP_COLUMN,
                                     (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), "GatedMLPMapping",
                                     (2 * shape.ffn, h), tp))
            out.append(MegatronParam(m + "mlp.linear_fc2.weight", Role.ROW, (p + "mlp.down_proj.weight",),
                                     "AutoMapping", (h, shape.ffn), tp))
    out.append(MegatronParam("decoder.final_layernorm.weight", Role.REPLICATED, ("model.norm.weight",),
                             "AutoMapping", (h,), 1))
    out.append(MegatronParam("output_layer.weight", Role.VOCAB_PARALLEL, ("lm_head.weight",), "AutoMapping",
                             (pv, h), tp))
    return out


_AXIS = {Role.REPLICATED: -1, Role.ROW: 1, Role.EXPERT_ROW: 1}  # every other role splits dim 0


class Shard(NamedTuple):
    """One rank's piece of a parameter, with the descriptor geometry the collector reports."""

    param: MegatronParam
    split_rank: int  # rank within ``param.split``
    local_shape: tuple[int, ...]
    shard_axis: int
    shard_offset: int
    extras: dict[str, int]


def rank_shards(shape: ModelShape, layout: TrainerLayout, rank: int) -> list[Shard]:
    """The shards global rank ``rank`` holds, in model order."""
    tp_rank, ep_rank = layout.position(rank)
    per_ep = shape.experts // layout.ep if shape.experts else 0
    shards: list[Shard] = []
    for prm in megatron_params(shape, layout):
        extras: dict[str, int] = {}
        if prm.expert is not None:
            if prm.expert // per_ep != ep_rank:
                continue  # another EP rank's expert
            extras["expert_id"] = prm.expert
        axis = _AXIS.get(prm.role, 0)
        split_rank = tp_rank % prm.split
        local = list(prm.global_shape)
        offset = 0
        if axis >= 0:
            local[axis] //= prm.split
            offset = split_rank * local[axis]
            extras.update(tp_rank=split_rank, tp_size=prm.split)  # the collector's extras
        shards.append(Shard(prm, split_rank, tuple(local), axis, offset, extras))
    return shards


def sidecar(shape: ModelShape, layout: TrainerLayout, shards: Iterable[Shard]) -> dict[str, Any]:
    """This rank's sidecar (``megatron.config`` + its part of ``megatron.hf_map``), as
    :func:`mx_refit.megatron.sidecar.build_sidecar` writes it."""
    config = {
        "num_layers": shape.layers,
        "hidden_size": shape.hidden,
        "num_attention_heads": shape.heads,
        "num_query_groups": shape.groups,
        "kv_channels": shape.head_dim,
        "ffn_hidden_size": shape.ffn,
        "moe_ffn_hidden_size": shape.moe_ffn if shape.moe_layers else None,
        "num_moe_experts": shape.experts if shape.moe_layers else None,
        "vocab_size": shape.vocab,
        "padded_vocab_size": layout.padded_vocab(shape.vocab),
        "tie_word_embeddings": False,
    }
    hf_map = {s.param.name: {"hf": list(s.param.hf), "mapping": s.param.mapping} for s in shards}
    return {"megatron.config": config, "megatron.hf_map": hf_map}


# --------------------------------------------------------------------------------------------
# Bytes: the deterministic HF export and the shards derived from it
# --------------------------------------------------------------------------------------------


def _seed(name: str, version: int) -> int:
    return zlib.crc32(f"{name}@v{version}".encode()) & _MASK31


def _hash_to_bf16(idx: "torch.Tensor", seed: int) -> "torch.Tensor":
    """Finite bf16 values from int64 element indices (consumed in place).

    Every product stays below 2**63, so the result is the same on every device and backend.
    """
    import torch

    h = idx.mul_(0x9E3779B1).add_(seed).bitwise_and_(_MASK31)
    h.bitwise_xor_(h >> 15).mul_(0x2C1B3C6D).bitwise_and_(_MASK31)
    h.bitwise_xor_(h >> 12).mul_(0x297A2D39).bitwise_and_(_MASK31)
    h.bitwise_xor_(h >> 15)
    # bf16 bits: exponent 120..127 and 7 mantissa bits from the low 10 bits (|x| in [2^-7, 2)),
    # sign from bit 10; subtracting 0x8000 sets the int16 sign bit without overflow.
    sign = (h >> 10).bitwise_and_(1).mul_(0x8000)
    bits = h.bitwise_and_(0x3FF).bitwise_or_(0x3C00).sub_(sign)
    return bits.to(torch.int16).view(torch.bfloat16)


def fill_hf_block(out: "torch.Tensor", name: str, full_shape: tuple[int, ...], version: int,
                  row0: int = 0, col0: int = 0) -> "torch.Tensor":
    """Write HF tensor ``name``'s block starting at ``(row0, col0)`` (version ``version``) into the
    contiguous bf16 tensor ``out``; its shape is the block's. Returns ``out``."""
    import torch

    if out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"{name}: fill target must be contiguous bf16, got {out.dtype} {tuple(out.stride())}")
    if math.prod(full_shape) >= 1 << 31:  # keeps the hash's int64 products exact
        raise ValueError(f"{name}: {full_shape} has 2**31 elements or more; use a smaller --scale")
    seed, dev = _seed(name, version), out.device
    if out.dim() == 1:
        for lo in range(0, out.numel(), _CHUNK_ELEMENTS):
            hi = min(lo + _CHUNK_ELEMENTS, out.numel())
            idx = torch.arange(row0 + lo, row0 + hi, dtype=torch.int64, device=dev)
            out[lo:hi].copy_(_hash_to_bf16(idx, seed))
        return out
    rows, cols = out.shape
    stride = full_shape[1]
    step = max(1, _CHUNK_ELEMENTS // max(cols, 1))
    col_idx = torch.arange(col0, col0 + cols, dtype=torch.int64, device=dev)
    for lo in range(0, rows, step):
        hi = min(lo + step, rows)
        idx = torch.arange(row0 + lo, row0 + hi, dtype=torch.int64, device=dev).mul_(stride)
        idx = idx[:, None] + col_idx[None, :]
        out[lo:hi].copy_(_hash_to_bf16(idx, seed))
    return out


def _qkv_pieces(shape: ModelShape, lo: int, hi: int) -> Iterator[tuple[int, int, int, int]]:
    """``(row in [lo, hi), rows, output 0/1/2 = q/k/v, HF row)`` runs of fused QKV rows
    ``[lo, hi)``: group ``g`` is ``[q heads g*r .. g*r+r-1 | k head g | v head g]``."""
    d, r = shape.head_dim, shape.heads // shape.groups
    group_rows = (r + 2) * d
    for g in range(lo // group_rows, -(-hi // group_rows)):
        base = g * group_rows
        for start, rows, out, dst in ((base, r * d, 0, g * r * d), (base + r * d, d, 1, g * d),
                                      (base + (r + 1) * d, d, 2, g * d)):
            a, b = max(lo, start), min(hi, start + rows)
            if a < b:
                yield a, b - a, out, dst + (a - start)


def write_shard(out: "torch.Tensor", shard: Shard, shape: ModelShape, version: int) -> None:
    """Fill ``out`` (contiguous bf16 of ``shard.local_shape``) with the rank's native bytes."""
    prm, t, shapes = shard.param, shard.split_rank, hf_shapes(shape)
    role = prm.role
    if role is Role.REPLICATED:
        fill_hf_block(out, prm.hf[0], shapes[prm.hf[0]], version)
    elif role in (Role.ROW, Role.EXPERT_ROW):
        fill_hf_block(out, prm.hf[0], shapes[prm.hf[0]], version, col0=shard.shard_offset)
    elif role is Role.VOCAB_PARALLEL:
        lo, rows = shard.shard_offset, shard.local_shape[0]
        real = max(0, min(lo + rows, shape.vocab) - lo)
        if real:
            fill_hf_block(out[:real], prm.hf[0], shapes[prm.hf[0]], version, row0=lo)
        if real < rows:  # Megatron's padding rows: junk the receiver must never deliver
            pad = prm.name + "#padding"
            fill_hf_block(out[real:], pad, (prm.global_shape[0], prm.global_shape[1]), version,
                          row0=lo + real)
    elif role is Role.QKV_COLUMN:
        lo = shard.shard_offset
        for row, rows, which, dst in _qkv_pieces(shape, lo, lo + shard.local_shape[0]):
            name = prm.hf[which]
            fill_hf_block(out[row - lo : row - lo + rows], name, shapes[name], version, row0=dst)
    elif role in (Role.GATED_MLP_COLUMN, Role.EXPERT_COLUMN):
        half = shard.local_shape[0] // 2  # rank t holds [gate_t; up_t]
        for i, name in enumerate(prm.hf):
            fill_hf_block(out[i * half : (i + 1) * half], name, shapes[name], version, row0=t * half)
    else:  # pragma: no cover - every role the model uses is handled above
        raise ValueError(f"{prm.name}: unhandled role {role}")


def rank_buffer(shards: list[Shard], device: str) -> tuple["torch.Tensor", list[PublishedTensor]]:
    """One contiguous bf16 buffer for all of a rank's shards (Megatron DDP keeps parameters as
    views of one buffer, each start padded to 64 elements) and the PublishedTensors over it."""
    import torch

    offsets, cursor = [], 0
    for s in shards:
        offsets.append(cursor)
        cursor += -(-math.prod(s.local_shape) // _DDP_ALIGN_ELEMENTS) * _DDP_ALIGN_ELEMENTS
    buf = torch.zeros(max(cursor, 1), dtype=torch.bfloat16, device=device)
    published = [
        PublishedTensor(
            name=s.param.name,
            tensor=buf[o : o + math.prod(s.local_shape)].view(s.local_shape),
            role=s.param.role,
            global_shape=s.param.global_shape,
            shard_axis=s.shard_axis,
            shard_offset=s.shard_offset,
            extras=dict(s.extras),
        )
        for s, o in zip(shards, offsets)
    ]
    return buf, published


# --------------------------------------------------------------------------------------------
# Receivers: expected windows and the byte check
# --------------------------------------------------------------------------------------------


class Window(NamedTuple):
    """Rows (``axis=0``) or columns (``axis=1``) ``[lo, hi)`` of an HF tensor."""

    axis: int
    lo: int
    hi: int


_EXPERT_RE = re.compile(r"\.experts\.(\d+)\.")


def _even(extent: int, parts: int, rank: int, what: str) -> tuple[int, int]:
    if extent % parts:
        raise ValueError(f"{what}: {extent} does not split evenly over target TP {parts}")
    size = extent // parts
    return rank * size, (rank + 1) * size


def expected_windows(shape: ModelShape, target: TargetLayout) -> dict[str, Window | None]:
    """``{hf_name: window, or None for the whole tensor}`` a vLLM worker at ``target`` holds."""
    T, t = target.tp_size, target.tp_rank
    per_ep = shape.experts // target.ep_size if shape.experts else 0
    if shape.groups >= T:
        kv = _even(shape.groups, T, t, "KV heads")
        kv_rows = (kv[0] * shape.head_dim, kv[1] * shape.head_dim)
    else:  # each KV head replicated over T / groups consecutive ranks
        head = t // (T // shape.groups)
        kv_rows = (head * shape.head_dim, (head + 1) * shape.head_dim)
    padded = -(-shape.vocab // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    per_vocab = -(-padded // T)
    vocab_lo = min(t * per_vocab, shape.vocab)
    vocab = (vocab_lo, min(vocab_lo + per_vocab, shape.vocab))

    out: dict[str, Window | None] = {}
    for name, full in hf_shapes(shape).items():
        match = _EXPERT_RE.search(name)
        if match and target.ep_size > 1:
            if int(match.group(1)) // per_ep != target.ep_rank:
                continue
            out[name] = None  # vLLM expert parallelism: expert TP is 1
            continue
        if target.full_tensors or len(full) == 1 or name.endswith("mlp.gate.weight"):
            out[name] = None  # norms, router
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            out[name] = Window(0, *vocab)
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            out[name] = Window(0, *kv_rows)
        elif name.endswith(("q_proj.weight", "gate_proj.weight", "up_proj.weight")):
            out[name] = Window(0, *_even(full[0], T, t, name))
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = Window(1, *_even(full[1], T, t, name))
        else:  # pragma: no cover - hf_shapes only makes the names above
            raise ValueError(f"no window rule for {name}")
    return out


def _window_shape(full: tuple[int, ...], window: Window | None) -> tuple[int, ...]:
    if window is None:
        return full
    dims = list(full)
    dims[window.axis] = window.hi - window.lo
    return tuple(dims)


def window_bytes(shape: ModelShape, target: TargetLayout) -> int:
    """Bytes a worker at ``target`` needs (what the plan's ``bytes_needed`` must equal)."""
    shapes = hf_shapes(shape)
    return sum(math.prod(_window_shape(shapes[n], w)) for n, w in expected_windows(shape, target).items()) \
        * ELEMENT_BYTES


@dataclass
class CheckReport:
    """The byte check of one receiver's tensors against the regenerated HF export."""

    checked: int = 0
    identical: int = 0
    bytes_checked: int = 0
    mismatched: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.mismatched or self.missing or self.unexpected) and self.checked > 0

    def as_dict(self, limit: int = 20) -> dict[str, Any]:
        lists = {"mismatched": self.mismatched, "missing": self.missing, "unexpected": self.unexpected}
        return {
            "checked": self.checked, "identical": self.identical, "bytes_checked": self.bytes_checked,
            **{k: len(v) for k, v in lists.items()},
            **{f"{k}_names": v[:limit] for k, v in lists.items() if v},
        }


def check_received(tensors: Iterable[tuple[str, "torch.Tensor"]], shape: ModelShape, target: TargetLayout,
                   version: int) -> CheckReport:
    """Compare every received ``(hf_name, tensor)`` with its window of the HF export, regenerated
    on the tensor's own device; bytes compared as int16 (so any bit difference counts)."""
    import torch

    expected = expected_windows(shape, target)
    shapes = hf_shapes(shape)
    report = CheckReport()
    seen: set[str] = set()
    for name, got in tensors:
        if name not in expected or name in seen:
            report.unexpected.append(name)
            continue
        seen.add(name)
        window = expected[name]
        want_shape = _window_shape(shapes[name], window)
        report.checked += 1
        if got.dtype != torch.bfloat16 or tuple(got.shape) != want_shape:
            report.mismatched.append(f"{name}: {got.dtype} {tuple(got.shape)} != bfloat16 {want_shape}")
            continue
        want = torch.empty(want_shape, dtype=torch.bfloat16, device=got.device)
        row0 = window.lo if window is not None and window.axis == 0 else 0
        col0 = window.lo if window is not None and window.axis == 1 else 0
        fill_hf_block(want, name, shapes[name], version, row0=row0, col0=col0)
        if torch.equal(got.view(torch.int16), want.view(torch.int16)):
            report.identical += 1
            report.bytes_checked += want.numel() * ELEMENT_BYTES
        else:
            report.mismatched.append(name)
    report.missing = [n for n in expected if n not in seen]
    return report
