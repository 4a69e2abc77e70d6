"""Argument checks and mode names shared by the config schema, the constructors and the plugins.

One home for "a finite number of seconds > 0", "an integer >= 1", "a non-empty string" and "one
of these modes", so the four places that take the same settings (``weight_sync`` config,
``Publisher``/``Receiver``, the vLLM infos, the Dynamo config mapping) agree on what is valid and
how a bad value is reported. Every check returns the value (normalised) or raises
:class:`~mx_refit.errors.InvalidArgument` naming the field and the value.

Two renderings of one failure: arguments read ``field: must be <expected>, got <value>``;
configuration keys (``setting=True``) read ``weight_sync.key: <value> (expected <expected>)``,
like the schema's type errors.

Plugins reach these through :mod:`mx_refit.config` (the front door); :func:`batches` through the
package root. Import-light: nothing here needs torch.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Iterator
from typing import Any, Protocol

from mx_refit.errors import InvalidArgument

__all__ = [
    "AUTO",
    "CATALOG_MODES",
    "CUDA_IPC",
    "DIRECT",
    "EMBEDDED",
    "FANOUT_MODES",
    "MIN_RECEIVE_BUFFER_BYTES",
    "NIXL",
    "NO_FANOUT",
    "PUBLISH_FORMATS",
    "RECEIVE_MODES",
    "STAGED",
    "STANDALONE",
    "TRANSPORT_MODES",
    "TREE",
    "batches",
    "check_count",
    "check_flag",
    "check_mode",
    "check_name",
    "check_receive_buffer_bytes",
    "check_receive_mode",
    "check_seconds",
]

# weight_sync.transport: auto picks a path per source; the others force one for every source.
AUTO = "auto"
NIXL = "nixl"
CUDA_IPC = "cuda_ipc"
TRANSPORT_MODES = (AUTO, NIXL, CUDA_IPC)

# weight_sync.fanout: none reads the trainer sources only; tree also reads (and offers) replicas.
NO_FANOUT = "none"
TREE = "tree"
FANOUT_MODES = (NO_FANOUT, TREE)

# weight_sync.publish_format: the trainer's dtype as is, or FP8 E4M3 with 128x128 block scales
# (mx_refit.fp8; the compile target "fp8_block").
PUBLISH_FORMATS = ("bf16", "fp8_block")

# weight_sync.receive_mode: staged = the receive arena holds the worker's whole version (pulled
# while the engine serves, committed in one short step); direct = the bytes go into the
# parameters through a registered buffer of at most weight_sync.receive_buffer_bytes, chunk by
# chunk, with generation paused (mx_refit.receive.direct).
STAGED = "staged"
DIRECT = "direct"
RECEIVE_MODES = (STAGED, DIRECT)
# The smallest receive buffer accepted. A buffer must also hold one row of the widest tensor
# (plus that row of its staged column blocks); the refit checks that before the first byte.
MIN_RECEIVE_BUFFER_BYTES = 4096

# weight_sync.catalog.mode: embedded (started in the trainer's driver) or a standalone server.
EMBEDDED = "embedded"
STANDALONE = "standalone"
CATALOG_MODES = (EMBEDDED, STANDALONE)


class _Sized(Protocol):
    """What :func:`batches` needs of a tensor (``torch.Tensor`` has both)."""

    def numel(self) -> int: ...
    def element_size(self) -> int: ...


def _reject(field: str, value: Any, expected: str, setting: bool) -> InvalidArgument:
    if setting:
        return InvalidArgument(f"{field}: {value!r} (expected {expected})")
    return InvalidArgument(f"{field}: must be {expected}, got {value!r}")


def _is_number(value: Any) -> bool:
    # bool is an int subclass: JSON `true` must not pass as a timeout or a size.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_seconds(value: Any, field: str, *, allow_zero: bool = False, setting: bool = False) -> float:
    """A finite number of seconds, > 0 (or >= 0 with ``allow_zero``); returned as a float."""
    if not _is_number(value) or not math.isfinite(value) or not (value >= 0 if allow_zero else value > 0):
        bound = ">= 0" if allow_zero else "> 0"
        raise _reject(field, value, f"a finite number of seconds {bound}", setting)
    return float(value)


def check_count(value: Any, field: str, *, minimum: int = 0, setting: bool = False) -> int:
    """An integer (not a bool) >= ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise _reject(field, value, f"an integer >= {minimum}", setting)
    return value


def check_name(value: Any, field: str, *, blank_ok: bool = True, setting: bool = False) -> str:
    """A non-empty string (model names, ids); with ``blank_ok=False`` also not only whitespace."""
    if not isinstance(value, str) or not (value if blank_ok else value.strip()):
        raise _reject(field, value, "a non-empty string" if blank_ok else "a non-blank string", setting)
    return value


def check_flag(value: Any, field: str, *, setting: bool = False) -> bool:
    """A bool (``1`` and ``"yes"`` are refused: protobuf and YAML coerce those silently)."""
    if not isinstance(value, bool):
        raise _reject(field, value, "true or false" if setting else "a bool", setting)
    return value


def check_mode(value: Any, field: str, modes: Collection[str]) -> str:
    """One of ``modes``: ``field: 'x' (expected 'a', 'b' or 'c')`` otherwise (one rendering)."""
    if value not in modes:
        quoted = [repr(m) for m in modes]
        listed = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
        raise InvalidArgument(f"{field}: {value!r} (expected {listed})")
    return str(value)


def check_receive_mode(value: Any, field: str) -> str:
    """``staged`` or ``direct``."""
    return check_mode(value, field, RECEIVE_MODES)


def check_receive_buffer_bytes(value: Any, field: str, *, setting: bool = False) -> int:
    """An integer (not a bool) >= :data:`MIN_RECEIVE_BUFFER_BYTES`."""
    return check_count(value, field, minimum=MIN_RECEIVE_BUFFER_BYTES, setting=setting)


def batches[T: _Sized](tensors: Iterable[tuple[str, T]], max_bytes: int) -> Iterator[list[tuple[str, T]]]:
    """``(name, tensor)`` pairs in order, grouped into lists of at most ``max_bytes`` each.

    A tensor larger than ``max_bytes`` travels alone (never split); the sum is of
    ``numel() * element_size()``, so any tensor-like object works. What a loader hands to an
    engine's ``load_weights`` per call, bounding its temporary memory.
    """
    batch: list[tuple[str, T]] = []
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if batch and size + nbytes > max_bytes:
            yield batch
            batch, size = [], 0
        batch.append((name, tensor))
        size += nbytes
    if batch:
        yield batch
