"""Checks that run before ``verify`` or ``demo`` start a single process.

Everything here reads only ``config.json`` and the file listing (no torch, no Megatron), so a
mistake in the command line costs a second, not a minute of model building followed by an error
buried in a JSON object. Each failure raises :class:`~mx_refit.errors.InvalidArgument` naming the
flag, its value and the checkpoint field it clashes with.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from mx_refit.errors import InvalidArgument, MissingExtra, require

__all__ = ["check_counts", "check_device", "check_layouts", "read_hf_config", "require_megatron_stack",
           "require_transport"]

# HF config keys that hold the routed-expert count, by model family.
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def check_counts(**counts: int | None) -> None:
    """Every given count is >= 1 (``source_tp=0`` -> ``--source-tp 0 must be >= 1``)."""
    for name, value in counts.items():
        if value is not None and value < 1:
            raise InvalidArgument(f"--{name.replace('_', '-')} {value} must be >= 1")


def check_device(device: str) -> None:
    """``cuda`` only where torch sees a CUDA device."""
    if device != "cuda":
        return
    require("torch", purpose="for --device cuda")
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        raise InvalidArgument("--device cuda: no CUDA device is available here (torch.cuda.is_available() is "
                              "False); use --device cpu")


def read_hf_config(hf_dir: str, flag: str = "--hf-dir") -> dict[str, Any]:
    """``config.json`` of an HF checkpoint directory that also holds safetensors weights."""
    if not os.path.exists(hf_dir):
        raise InvalidArgument(f"{flag} {hf_dir!r} does not exist")
    if not os.path.isdir(hf_dir):
        raise InvalidArgument(f"{flag} {hf_dir!r} is not a directory")
    path = os.path.join(hf_dir, "config.json")
    try:
        with open(path) as handle:
            config = json.load(handle)
    except FileNotFoundError:
        raise InvalidArgument(f"{flag} {hf_dir!r} has no config.json (expected an HF checkpoint directory)") from None
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{flag} {hf_dir!r}: config.json cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise InvalidArgument(f"{flag} {hf_dir!r}: config.json is not a JSON object")
    if not config.get("model_type"):
        raise InvalidArgument(f"{flag} {hf_dir!r}: config.json has no 'model_type' (Megatron-Bridge needs it "
                              "to pick the model family)")
    if not any(name.endswith(".safetensors") for name in os.listdir(hf_dir)):
        raise InvalidArgument(f"{flag} {hf_dir!r} has no *.safetensors weights")
    return config


def _field(config: Mapping[str, Any], *keys: str) -> tuple[str, int] | None:
    """The first present integer field among ``keys`` (also under ``text_config``)."""
    for scope in (config, config.get("text_config") or {}):
        for key in keys:
            value = scope.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return key, value
    return None


def check_layouts(config: Mapping[str, Any], *, source_tp: int = 1, source_pp: int = 1, source_ep: int = 1,
                  source_etp: int | None = None, source_dp: int | None = None,
                  targets: Iterable[tuple[int, int]] = ((1, 1),), flag_prefix: str = "--") -> None:
    """Heads and KV heads against TP, layers against PP, experts against EP, the expert mesh
    against the data-parallel size.

    Megatron-Core (the source) needs ``heads % tp == 0`` and KV groups that are a multiple or a
    divisor of TP (with fewer groups than ranks each rank holds one group, replicated); so does
    an inference worker (the target). ``tp * dp`` ranks per pipeline stage must hold whole
    expert meshes (``etp * ep``); ``source_dp=None`` leaves the data-parallel size to the caller.
    """
    heads = _field(config, "num_attention_heads", "n_head")
    kv = _field(config, "num_key_value_heads", "num_query_groups") or heads
    layers = _field(config, "num_hidden_layers", "n_layer")
    experts = _field(config, *_EXPERT_KEYS)
    p = flag_prefix

    def clash(flag: str, value: int, field: tuple[str, int], why: str) -> InvalidArgument:
        return InvalidArgument(f"{p}{flag} {value}: {why} {field[0]}={field[1]} in config.json")

    if heads and heads[1] % source_tp:
        raise clash("source-tp", source_tp, heads, "does not divide")
    if kv and kv[1] % source_tp and source_tp % kv[1]:
        raise clash("source-tp", source_tp, kv, "neither divides nor is a multiple of")
    if layers and layers[1] % source_pp:
        raise clash("source-pp", source_pp, layers, "does not divide")
    if source_ep > 1 and not (experts and experts[1] > 0):
        raise InvalidArgument(f"{p}source-ep {source_ep}: the model is dense (config.json names no experts: "
                              f"none of {', '.join(_EXPERT_KEYS)}); use --source-ep 1")
    if experts and experts[1] > 0 and experts[1] % source_ep:
        raise clash("source-ep", source_ep, experts, "does not divide")
    etp = source_tp if source_etp is None else source_etp
    if source_dp is not None and (source_tp * source_dp) % (etp * source_ep):
        raise InvalidArgument(
            f"{p}source-dp {source_dp}: tp x dp = {source_tp * source_dp} ranks per pipeline stage do not hold "
            f"whole expert meshes of etp x ep = {etp * source_ep} ranks (Megatron needs tp x dp divisible by "
            "etp x ep)")
    for tp, ep in targets:
        if heads and heads[1] % tp:
            raise clash("target-tp", tp, heads, "does not divide")
        if kv and kv[1] % tp and tp % kv[1]:
            raise clash("target-tp", tp, kv, "neither divides nor is a multiple of")
        if ep > 1 and not (experts and experts[1] > 0):
            raise InvalidArgument(f"{p}target-ep {ep}: the model is dense (config.json names no experts); "
                                  "use --target-ep 1")
        if experts and experts[1] > 0 and experts[1] % ep:
            raise clash("target-ep", ep, experts, "does not divide")


def require_transport(*, nixl: bool = True) -> None:
    """torch and a NIXL build are installed (``mx-refit[transport]``).

    ``nixl=False``: only torch (every process on this node with CUDA tensors: CUDA IPC carries
    the bytes, and NIXL is needed only if a source cannot be read over IPC, which then fails
    naming the reason)."""
    require("torch", purpose="to publish and receive tensors")
    if nixl and not any(_has(name) for name in ("nixl", "nixl_cu13", "nixl_cu12")):
        raise MissingExtra("nixl", "transport", "to move tensors between processes")


def require_megatron_stack() -> None:
    """The transport plus megatron-core, Megatron-Bridge, transformers and safetensors."""
    require_transport()
    for module in ("megatron.core", "megatron.bridge", "transformers", "safetensors"):
        if not _has(module):
            raise MissingExtra(module, "megatron", "to build Megatron-Core ranks from an HF checkpoint")


def _has(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
