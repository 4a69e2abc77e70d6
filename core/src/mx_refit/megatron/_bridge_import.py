"""Import Megatron-Bridge on machines without TransformerEngine.

Megatron-Bridge 0.6.2 imports ``transformer_engine.pytorch`` unconditionally (``peft/lora_layers.py``)
although nothing on the conversion path needs it, and TransformerEngine cannot be built without a
CUDA toolkit. The dance below lets the bridge import anyway:

1. import the megatron-core modules that probe for TE *first*, so their ``HAVE_TE`` flags cache
   ``False`` while TE is truly absent (``get_te_version()`` caches ``0.0.0``);
2. put a permissive stub package into ``sys.modules`` just for the ``megatron.bridge`` import
   (its classes raise on instantiation, submodule imports still fail so ``try: import`` guards
   stay false);
3. remove the stub right after, so nothing else ever sees a fake TransformerEngine.

When a real TransformerEngine is importable none of this happens. The result is cached; a failed
import is cached too (``bridge_import_error()`` says why) so callers can fall back cheaply.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import threading
import types
from typing import Any

__all__ = ["bridge_available", "bridge_import_error", "import_bridge"]

_TE_NAMES = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.ops")
_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}  # "module" -> megatron.bridge, or "error" -> the import exception


class _TEStubObject:
    """Base of every stub class: using one is a bug, so it fails loudly."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("transformer_engine is an import-time stub here (mx_refit.megatron._bridge_import)")


def _stub_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    module.__path__ = []  # a package with no submodules: `import transformer_engine.pytorch.x` fails
    cache: dict[str, type] = {}

    def __getattr__(attr: str) -> type:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr not in cache:
            cache[attr] = type(attr, (_TEStubObject,), {})
        return cache[attr]

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


def _install_te_stub() -> list[str]:
    """Insert the stub modules; returns the names actually inserted (never shadows real ones)."""
    te, te_pytorch, te_ops = (_stub_module(n) for n in _TE_NAMES)
    te_pytorch.ops = te_ops  # type: ignore[attr-defined]
    te.pytorch = te_pytorch  # type: ignore[attr-defined]
    inserted = []
    for name, module in zip(_TE_NAMES, (te, te_pytorch, te_ops), strict=True):
        if name not in sys.modules:
            sys.modules[name] = module
            inserted.append(name)
    return inserted


def _pre_import_megatron_core() -> None:
    """Import the megatron-core modules that probe for TE while TE is still absent."""
    import megatron.core  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.tensor_parallel  # noqa: F401
    import megatron.core.transformer.transformer_layer  # noqa: F401
    from megatron.core.utils import get_te_version

    get_te_version()  # caches "0.0.0"; with the stub in place it would raise on __version__
    for optional in ("megatron.core.models.hybrid.hybrid_layer_specs", "megatron.training.config"):
        try:
            importlib.import_module(optional)
        except ImportError:
            pass  # absent in some megatron-core builds; they only matter if bridge imports them


def _real_te_available() -> bool:
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


def import_bridge() -> Any:
    """Return the ``megatron.bridge`` module, importing it (with the TE stub if needed) once.

    Raises ``ImportError`` when Megatron-Bridge (or megatron-core) is not installed or cannot be
    imported; the error is cached so repeated calls are cheap.
    """
    with _LOCK:
        if "module" in _STATE:
            return _STATE["module"]
        if "error" in _STATE:
            raise ImportError(f"megatron.bridge is not importable: {_STATE['error']}") from _STATE["error"]
        try:
            module = _import_locked()
        except Exception as exc:  # ImportError, or a bridge module failing at import time
            _STATE["error"] = exc
            raise ImportError(f"megatron.bridge is not importable: {exc}") from exc
        _STATE["module"] = module
        return module


def _import_locked() -> Any:
    if "megatron.bridge" in sys.modules and "megatron.bridge.models.conversion.param_mapping" in sys.modules:
        return sys.modules["megatron.bridge"]
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.bridge") is None:
        raise ImportError("megatron-bridge is not installed")
    if _real_te_available():
        import megatron.bridge
        import megatron.bridge.models.conversion.param_mapping  # noqa: F401

        return megatron.bridge
    _pre_import_megatron_core()
    inserted = _install_te_stub()
    try:
        import megatron.bridge
        import megatron.bridge.models.conversion.param_mapping  # noqa: F401
        import megatron.bridge.models.gpt_provider  # noqa: F401  (local_layer_spec lives here)
    finally:
        for name in inserted:
            sys.modules.pop(name, None)
    return megatron.bridge


def bridge_available() -> bool:
    """True when ``import_bridge()`` succeeds (it is attempted at most once per process)."""
    try:
        import_bridge()
    except ImportError:
        return False
    return True


def bridge_import_error() -> BaseException | None:
    """The exception a failed ``import_bridge()`` raised, or ``None``."""
    return _STATE.get("error")
