"""The receive side: what an inference worker runs to take in new weights.

- ``receiver``: :class:`~mx_refit.Receiver`, the public face (options, parts, ``from_config``).
- ``cycle``: :class:`RefitCycle`, one refit phase by phase, and :class:`~mx_refit.RefitResult`.
- ``options``: the receiver's settings, checked once.
- ``lease_order``: when the lease is taken (in discovery, or after planning).
- ``plans``: the plan cache (plan, coalesced reads, checksum widening) by layout.
- ``lease``: the lease held for the whole pull (renewals, deadline, release).
- ``fanout``: tree fan-out, pure: which holder serves which bytes.
- ``replica``: a receiver's arena offered as a replica source.
- ``failover``: a source failing mid-pull has its ranges read from another holder.
- ``overlap``: with checksums, a DRAM arena summed batch by batch while the next batch transfers.

Users import :class:`~mx_refit.Receiver` and :class:`~mx_refit.RefitResult` from ``mx_refit``.
"""
