"""Tiny HF Qwen2 checkpoints for the plugins' tests (built from a config, no downloads; torch,
transformers and safetensors are imported only when one is built or loaded).

Version ``v`` of the weights is its own checkpoint directory, so every process (the vLLM
workers' reference models, the torch trainer, the Megatron trainer in the core venv) reads the
exact same bytes for it. Values are seeded random (HF would zero biases and set norms to one),
so a misplaced row, head or bias shows up in a byte comparison.

Qwen2 is chosen for its awkward corners: q/k/v biases, tied embeddings, GQA (4 q / 2 kv heads)
and a vocabulary of 131 that no TP > 1 divides (Megatron pads it, vLLM pads it differently).
``build_version(root, v, tied=False)`` writes the same model with its own ``lm_head.weight``
(an untied, vocabulary-parallel output layer on both sides).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["CONFIG", "build_version", "load_version", "tensor_digest"]

CONFIG: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 131,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "hidden_act": "silu",
    "use_sliding_window": False,
}


def build_version(root: Path, version: int, *, tied: bool = True) -> Path:
    """Write (once) and return the checkpoint directory of weights version ``version``
    (``tied=False``: untied embeddings, a separate ``lm_head.weight``)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    stem = "qwen2" if tied else "qwen2-untied"
    out = root / f"{stem}-v{version}"
    if (out / "model.safetensors").exists():
        return out
    tmp = root / f".{stem}-v{version}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    settings = {**CONFIG, "tie_word_embeddings": tied}
    config = transformers.Qwen2Config(
        **{k: v for k, v in settings.items() if k not in ("architectures", "model_type")}
    )
    with torch.device("meta"):
        names = {n: tuple(p.shape) for n, p in transformers.Qwen2ForCausalLM(config).named_parameters()}
    gen = torch.Generator().manual_seed(1000 + version)
    tensors = {
        name: (torch.randn(shape, generator=gen) * 0.05).contiguous() for name, shape in sorted(names.items())
    }
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(settings, indent=1))
    tmp.rename(out)
    return out


def load_version(path: Path | str) -> dict[str, "torch.Tensor"]:
    """The tensors of a checkpoint written by :func:`build_version`, by HF name."""
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


def tensor_digest(tensor: "torch.Tensor") -> str:
    """A short fingerprint of a tensor's bytes, dtype and shape, to compare what two processes hold."""
    import torch

    t = tensor.detach().contiguous().cpu()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()[:24] + f"|{t.dtype}|{tuple(t.shape)}"
