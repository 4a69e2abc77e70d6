"""The model sidecar a trainer rank publishes next to its shards, built from Megatron-Bridge.

Two keys (each rank sends its part; the catalog merges them recursively):

- ``"megatron.config"``: the transformer geometry a receiver needs to translate native shards
  (heads, query groups, kv_channels, hidden / ffn sizes, experts, HF and padded vocabulary, tied
  embeddings). Identical on every rank.
- ``"megatron.hf_map"``: ``{megatron_name: {"hf": [hf names], "mapping": "<Bridge mapping class>"}}``
  for the parameters this rank holds (PP ranks contribute their layers, EP ranks their experts),
  taken from Bridge's conversion tasks: no per-model name tables here. QKV lists ``[q, k, v]``,
  gated MLPs and expert fc1 ``[gate, up]``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mx_refit.megatron.classify import BridgeKind, ClassificationError, strip_wrapper_prefix
from mx_refit.megatron.parallel import innermost_module, unwrap_model

__all__ = [
    "CONFIG_KEY",
    "HF_MAP_KEY",
    "bridge_mapping_kinds",
    "build_sidecar",
    "conversion_tasks",
    "hf_names_of",
    "megatron_config",
]

CONFIG_KEY = "megatron.config"
HF_MAP_KEY = "megatron.hf_map"

# HF names of multi-tensor mappings, in the order the schema promises.
_ORDERED_KEYS: dict[str, tuple[str, ...]] = {
    "QKVMapping": ("q", "k", "v"),
    "GatedMLPMapping": ("gate", "up"),
}


def conversion_tasks(bridge: Any, model: Any) -> list[Any]:
    """``bridge.get_conversion_tasks(model)`` without the ``None`` holes.

    A collective over the pipeline group: every rank of the job must call it together.
    """
    return [task for task in bridge.get_conversion_tasks(unwrap_model(model)) if task is not None]


def hf_names_of(mapping: Any) -> list[str]:
    """The HF tensor names one resolved Bridge mapping produces, in schema order."""
    hf = mapping.hf_param
    if isinstance(hf, str):
        return [hf]
    if not isinstance(hf, Mapping):
        raise ClassificationError(f"{mapping.megatron_param}: unexpected hf_param {hf!r}")
    order = _ORDERED_KEYS.get(type(mapping).__name__)
    if order is not None and set(hf) == set(order):
        return [hf[key] for key in order]
    return list(hf.values())  # Bridge's own declaration order


def _local_tasks(tasks: Iterable[Any]) -> list[Any]:
    """Tasks for parameters this rank holds (Bridge adds placeholders for other PP stages)."""
    return [t for t in tasks if t.param_weight is not None and t.megatron_module is not None]


def bridge_mapping_kinds(tasks: Iterable[Any]) -> dict[str, BridgeKind]:
    """``{published name: BridgeKind}`` for this rank's parameters.

    ``AutoMapping`` resolves its parallelism lazily on first use; the detection is a pure
    function of the module (``_detect_parallelism_type``), so it is run here without collectives.
    """
    kinds: dict[str, BridgeKind] = {}
    for task in _local_tasks(tasks):
        mapping = task.mapping
        detected = getattr(mapping, "_detected_type", None)
        if detected is None and hasattr(mapping, "_detect_parallelism_type"):
            try:
                detected = mapping._detect_parallelism_type(task.megatron_module)  # noqa: SLF001
            except ValueError:
                continue  # Bridge cannot tell either: leave it to the Megatron-Core attributes
        kinds[strip_wrapper_prefix(task.global_param_name)] = BridgeKind(type(mapping).__name__, detected)
    return kinds


def _padded_vocab_size(model: Any) -> int | None:
    for chunk in unwrap_model(model):
        inner = innermost_module(chunk)
        vocab = getattr(inner, "vocab_size", None)  # GPTModel keeps the padded size it was built with
        if isinstance(vocab, int):
            return vocab
    return None


def megatron_config(model: Any, hf_config: Any | None = None) -> dict[str, Any]:
    """The ``"megatron.config"`` sidecar entry from the model's TransformerConfig."""
    chunks = unwrap_model(model)
    inner = innermost_module(chunks[0])
    cfg = inner.config
    kv_channels = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    padded = _padded_vocab_size(chunks)
    hf_vocab = getattr(hf_config, "vocab_size", None) if hf_config is not None else None
    if hf_vocab is None:
        hf_vocab = padded
    text_config = getattr(hf_config, "get_text_config", None)
    tie = getattr(inner, "share_embeddings_and_output_weights", None)
    if tie is None and hf_config is not None:
        tie = getattr(text_config() if callable(text_config) else hf_config, "tie_word_embeddings", False)
    return {
        "num_layers": int(cfg.num_layers),
        "hidden_size": int(cfg.hidden_size),
        "num_attention_heads": int(cfg.num_attention_heads),
        "num_query_groups": int(cfg.num_query_groups or cfg.num_attention_heads),
        "kv_channels": int(kv_channels),
        "ffn_hidden_size": int(cfg.ffn_hidden_size) if cfg.ffn_hidden_size else None,
        "moe_ffn_hidden_size": int(cfg.moe_ffn_hidden_size) if cfg.moe_ffn_hidden_size else None,
        "num_moe_experts": int(cfg.num_moe_experts) if cfg.num_moe_experts else None,
        "vocab_size": int(hf_vocab) if hf_vocab is not None else None,
        "padded_vocab_size": int(padded) if padded is not None else None,
        "tie_word_embeddings": bool(tie),
    }


def hf_map(tasks: Sequence[Any]) -> dict[str, dict[str, Any]]:
    """The ``"megatron.hf_map"`` entries for the parameters this rank holds."""
    entries: dict[str, dict[str, Any]] = {}
    for task in _local_tasks(tasks):
        name = strip_wrapper_prefix(task.global_param_name)
        entries[name] = {"hf": hf_names_of(task.mapping), "mapping": type(task.mapping).__name__}
    return entries


def build_sidecar(bridge: Any, model: Any, hf_config: Any | None = None, *,
                  tasks: Sequence[Any] | None = None) -> dict[str, Any]:
    """This rank's sidecar: ``{"megatron.config": {...}, "megatron.hf_map": {...}}``.

    ``tasks`` reuses already computed conversion tasks (computing them is a PP collective).
    """
    if tasks is None:
        tasks = conversion_tasks(bridge, model)
    if hf_config is None:
        hf_config = getattr(getattr(bridge, "hf_pretrained", None), "config", None)
    return {CONFIG_KEY: megatron_config(model, hf_config), HF_MAP_KEY: hf_map(tasks)}
