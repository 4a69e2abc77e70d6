"""A receiver's settings: checked once, before anything is built, connected or leased, and read
by the refit cycle at every refit (a setting changed between refits applies to the next one)."""

from __future__ import annotations

from dataclasses import dataclass

from mx_refit.checks import (
    DIRECT,
    FANOUT_MODES,
    NO_FANOUT,
    STAGED,
    check_count,
    check_flag,
    check_mode,
    check_name,
    check_receive_buffer_bytes,
    check_receive_mode,
    check_seconds,
)
from mx_refit.config import (
    DEFAULT_LEASE_TTL_S,
    DEFAULT_LOAD_BATCH_BYTES,
    DEFAULT_RECEIVE_BUFFER_BYTES,
    DEFAULT_TRANSFER_TIMEOUT_S,
)
from mx_refit.errors import InvalidArgument

__all__ = ["ReceiveOptions"]


@dataclass
class ReceiveOptions:
    """What :class:`~mx_refit.Receiver` was asked for (see its parameters); kept as given."""

    model: str
    reader_id: str
    device: str = "cpu"
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S
    load_batch_bytes: int = DEFAULT_LOAD_BATCH_BYTES
    checksums: bool = False
    fanout: str = NO_FANOUT
    max_readers_per_source: int = 0
    delta: str = "off"
    delta_check_arena: bool = True
    receive_mode: str = STAGED
    receive_buffer_bytes: int = DEFAULT_RECEIVE_BUFFER_BYTES

    def __post_init__(self) -> None:
        check_seconds(self.lease_ttl_s, "lease_ttl_s")
        check_seconds(self.transfer_timeout_s, "transfer_timeout_s")
        check_count(self.load_batch_bytes, "load_batch_bytes", minimum=1)
        check_name(self.model, "model")
        check_flag(self.checksums, "checksums")
        check_mode(self.fanout, "fanout", FANOUT_MODES)
        check_count(self.max_readers_per_source, "max_readers_per_source")
        check_mode(self.delta, "delta", ("off", "auto", "on"))
        check_flag(self.delta_check_arena, "delta_check_arena")
        check_receive_mode(self.receive_mode, "receive_mode")
        check_receive_buffer_bytes(self.receive_buffer_bytes, "receive_buffer_bytes")
        if self.receive_mode == DIRECT:
            self._check_direct()
        if self.delta != "off":
            self.checksums = True  # a delta is applied only onto verified bytes, and verified

    def _check_direct(self) -> None:
        """What needs a whole-version arena cannot run in ``direct`` mode (its bytes go into the
        parameters chunk by chunk): refused by name here, before anything is built."""
        clash = {
            "fanout": (self.fanout != NO_FANOUT, "offers the receive arena as a replica"),
            "delta": (self.delta != "off", "applies a delta onto the version held in the arena"),
            "checksums": (self.checksums, "verifies the whole version before anything is loaded"),
        }
        for field, (on, why) in clash.items():
            if on:
                raise InvalidArgument(
                    f"{field}: {getattr(self, field)!r} {why}; receive_mode 'direct' keeps no arena "
                    f"(it writes the parameters chunk by chunk): use receive_mode 'staged' or turn {field} off"
                )

    @property
    def names_sources(self) -> bool:
        """Whether leases name the sources they read (fan-out or a reader cap): the sources are
        chosen from the plan, so the lease is taken after planning."""
        return self.fanout != NO_FANOUT or bool(self.max_readers_per_source)
