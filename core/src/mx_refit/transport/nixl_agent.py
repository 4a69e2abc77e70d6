"""Creating the NIXL agent behind :class:`~mx_refit.transport.nixl.NixlTransport`, and locating
tensors in NIXL's terms (memory type, device, byte span).

The agent runs without the listen thread: metadata travels through the catalog (the source's
``get_agent_metadata``, the reader's ``add_remote_agent``), never over NIXL's own socket.

Idle cost: NIXL's Python wrapper (1.5.1) starts UCX's progress thread with ``pthrDelay=0``, so
its ``poll()`` on the workers' event fds never blocks and an idle agent burns 65-100% of a core.
:func:`create_agent` gives the thread a wake-up period instead (``progress_wake_ms``): it then
sleeps in ``poll()`` until UCX signals an event (a peer's READ arriving over tcp, a wire-up) or
the period passes, costing well under 1% of a core idle with unchanged pull figures
(``benchmarks/bench_idle.py``). The thread is still needed: without it a passive source whose
peer reads over a two-sided transport (tcp) never answers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mx_refit.errors import InvalidArgument

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["DEFAULT_PROGRESS_WAKE_MS", "as_str", "create_agent", "load_nixl", "tensor_location", "tensor_span"]

log = logging.getLogger(__name__)

# UCX progress thread wake-up period. Events wake it at once; the period only bounds the delay
# after an event that poll() missed (NIXL works around such a UCX bug the same way).
DEFAULT_PROGRESS_WAKE_MS = 20.0
_AGENT_INIT_LOCK = threading.Lock()


def load_nixl() -> tuple[Any, Any]:
    """Import ``nixl_agent``/``nixl_agent_config``; the meta package first, then a bare variant
    (installing only ``nixl-cu12``/``nixl-cu13`` provides no ``nixl`` module)."""
    from mx_refit.preflight import require_transport

    require_transport()  # without torch or NIXL: MissingExtra, "install `mx-refit[transport]`"
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl_cu13._api import nixl_agent, nixl_agent_config  # type: ignore[no-redef]
        except ImportError:
            from nixl_cu12._api import nixl_agent, nixl_agent_config  # type: ignore[no-redef]
    from mx_refit._logsetup import route_nixl_logs_to_stderr

    route_nixl_logs_to_stderr()  # NIXL logs to stdout by default; stdout belongs to the caller
    return nixl_agent, nixl_agent_config


def create_agent(name: str, backends: Sequence[str], progress_wake_ms: float | None) -> Any:
    """A NIXL agent without the listen thread, its UCX progress thread waking every
    ``progress_wake_ms`` (``0``: NIXL's default busy poll; ``None``: no progress thread).

    The wrapper exposes no delay option and sets ``pthrDelay = 0`` on the config it builds, so the
    delay is set on that config as it reaches the bindings' ``nixlAgent`` constructor, for the
    duration of this one construction (serialised by a lock)."""
    nixl_agent, nixl_agent_config = load_nixl()
    config = nixl_agent_config(
        enable_prog_thread=progress_wake_ms is not None, enable_listen_thread=False, backends=list(backends)
    )
    if not progress_wake_ms:
        return nixl_agent(name, config)
    import sys

    bindings: Any = getattr(sys.modules.get(nixl_agent.__module__), "nixlBind", None)
    construct = getattr(bindings, "nixlAgent", None)
    if construct is None:  # a wrapper laid out differently: keep its default, say so
        log.warning("NIXL wrapper %s has no nixlBind.nixlAgent; progress thread left busy-polling",
                    nixl_agent.__module__)
        return nixl_agent(name, config)
    delay_us = max(1, int(progress_wake_ms * 1000))

    def with_wake_period(agent_name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = delay_us
        return construct(agent_name, agent_config)

    with _AGENT_INIT_LOCK:
        bindings.nixlAgent = with_wake_period
        try:
            return nixl_agent(name, config)
        finally:
            bindings.nixlAgent = construct


def as_str(name: str | bytes) -> str:
    """An agent name as ``str`` (``add_remote_agent`` returns it as ``bytes``)."""
    return name.decode() if isinstance(name, (bytes, bytearray)) else str(name)


def tensor_location(tensor: "torch.Tensor") -> tuple[str, int]:
    """(NIXL memory type, device id) of a tensor."""
    dev = tensor.device
    if dev.type == "cpu":
        return "DRAM", 0
    if dev.type == "cuda":
        if dev.index is not None:
            return "VRAM", dev.index
        import torch

        return "VRAM", torch.cuda.current_device()
    raise InvalidArgument(f"tensor.device: {dev} is not supported (cpu or cuda only)")


def tensor_span(tensor: "torch.Tensor") -> tuple[int, int]:
    """(address, nbytes) of the bytes a (possibly non-contiguous) tensor can touch."""
    if tensor.numel() == 0:
        return tensor.data_ptr(), 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.data_ptr(), (last + 1) * tensor.element_size()
