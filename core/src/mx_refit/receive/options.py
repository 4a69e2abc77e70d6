"""A receiver's settings: checked once, before anything is built, connected or leased, and read
by the refit cycle at every refit (a setting changed between refits applies to the next one)."""

from __future__ import annotations

from dataclasses import dataclass

from mx_refit.errors import InvalidArgument

__all__ = ["FANOUT_MODES", "ReceiveOptions"]

FANOUT_MODES = ("none", "tree")


@dataclass
class ReceiveOptions:
    """What :class:`~mx_refit.Receiver` was asked for (see its parameters)."""

    model: str
    reader_id: str
    device: str = "cpu"
    lease_ttl_s: float = 60.0
    transfer_timeout_s: float = 120.0
    load_batch_bytes: int = 512 << 20
    checksums: bool = False
    fanout: str = "none"
    max_readers_per_source: int = 0

    def __post_init__(self) -> None:
        for name, value in (("lease_ttl_s", self.lease_ttl_s), ("transfer_timeout_s", self.transfer_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < float("inf")):
                raise InvalidArgument(f"{name}: must be a finite number of seconds > 0, got {value!r}")
        batch = self.load_batch_bytes
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise InvalidArgument(f"load_batch_bytes: must be an integer >= 1, got {batch!r}")
        if not isinstance(self.model, str) or not self.model:
            raise InvalidArgument(f"model: must be a non-empty string, got {self.model!r}")
        if not isinstance(self.checksums, bool):
            raise InvalidArgument(f"checksums: must be a bool, got {self.checksums!r}")
        if self.fanout not in FANOUT_MODES:
            raise InvalidArgument(f"fanout: {self.fanout!r} (expected 'none' or 'tree')")
        cap = self.max_readers_per_source
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise InvalidArgument(f"max_readers_per_source: must be an integer >= 0, got {cap!r}")

    @property
    def names_sources(self) -> bool:
        """Whether leases name the sources they read (fan-out or a reader cap): the sources are
        chosen from the plan, so the lease is taken after planning."""
        return self.fanout != "none" or bool(self.max_readers_per_source)
