"""The express lane: a steady refit's catalog calls over one persistent TCP connection.

A steady refit makes one catalog call on its critical path (``LeaseVersion``; its release is
sent afterwards, see :mod:`mx_refit.receive.lease`). Over Python gRPC that call costs 1.5-2.3 ms
after the reader sat idle, whatever the server model (sync or ``grpc.aio``): the request and
the reply each cross several threads. Measured on the 2-core CI machine with 20 ms idle
between calls, a bare gRPC echo took 1.45 ms and the same bytes over a blocking socket
0.13 ms; the catalog's own work for the call is ~0.04 ms. On a 10-20 ms colocated pull that
difference is the whole gap between the refit and its pull.

The lane carries the same request and reply messages to the same :class:`CatalogServicer`
methods (so the same validation, errors and digests), after the same bearer token, for the
calls in :data:`~mx_refit.catalog.express.framing.EXPRESS_METHODS` only. The catalog offers it
in ``LeaseVersionReply.express_port``; a client dials it on its next call and falls back to
gRPC for good on any failure of the lane itself (every express call is idempotent, so a call
cut mid-way is simply made again over gRPC). Nothing else changes: every other call stays on
gRPC.

One module per part, each importing only :mod:`~mx_refit.catalog.express.framing`:

* :mod:`~mx_refit.catalog.express.framing` — the wire: frames, the methods it carries, its
  size cap, and :class:`~mx_refit.catalog.express.framing.ExpressStatus` (a non-OK answer).
* :mod:`~mx_refit.catalog.express.server` — :class:`ExpressServer`, the catalog's listener,
  which calls the servicer that gRPC calls.
* :mod:`~mx_refit.catalog.express.client` — the reader's side: :class:`ExpressClient` (one
  connection) and :class:`ExpressRoute` (when a :class:`~mx_refit.catalog.client.CatalogClient`
  dials, uses and drops the lane).
"""
