"""A receiver's settings: checked once, before anything is built, connected or leased, and read
by the refit cycle at every refit (a setting changed between refits applies to the next one)."""

from __future__ import annotations

from dataclasses import dataclass

from mx_refit.checks import FANOUT_MODES, NO_FANOUT, check_count, check_flag, check_mode, check_name, check_seconds
from mx_refit.config import DEFAULT_LEASE_TTL_S, DEFAULT_LOAD_BATCH_BYTES, DEFAULT_TRANSFER_TIMEOUT_S

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

    def __post_init__(self) -> None:
        check_seconds(self.lease_ttl_s, "lease_ttl_s")
        check_seconds(self.transfer_timeout_s, "transfer_timeout_s")
        check_count(self.load_batch_bytes, "load_batch_bytes", minimum=1)
        check_name(self.model, "model")
        check_flag(self.checksums, "checksums")
        check_mode(self.fanout, "fanout", FANOUT_MODES)
        check_count(self.max_readers_per_source, "max_readers_per_source")
        check_mode(self.delta, "delta", ("off", "auto"))
        check_flag(self.delta_check_arena, "delta_check_arena")
        if self.delta == "auto":
            self.checksums = True  # a delta is applied only onto verified bytes, and verified

    @property
    def names_sources(self) -> bool:
        """Whether leases name the sources they read (fan-out or a reader cap): the sources are
        chosen from the plan, so the lease is taken after planning."""
        return self.fanout != NO_FANOUT or bool(self.max_readers_per_source)
