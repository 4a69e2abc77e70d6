"""Catalog addresses: what a client may dial (pure, no grpc)."""

from __future__ import annotations

from mx_refit.errors import InvalidArgument

__all__ = ["check_address"]

# gRPC target schemes passed through as given (``unix:/path``, ``dns:///host:port``, ...).
_GRPC_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:")


def check_address(address: object, field: str = "address") -> str:
    """A catalog address ``host:port`` (``[v6]:port`` too), or a gRPC target with its scheme.

    An address without a port is refused here: gRPC would silently dial port 443.
    """
    if not isinstance(address, str) or not address.strip():
        raise InvalidArgument(f"{field}: must be a non-empty 'host:port' string, got {address!r}")
    if address.startswith(_GRPC_SCHEMES):
        return address
    host, sep, port = address.rpartition(":") if not address.endswith("]") else ("", "", "")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise InvalidArgument(f"{field}: {address!r}: an IPv6 address goes in brackets, e.g. [::1]:50551")
    if not sep or not host:
        raise InvalidArgument(
            f"{field}: {address!r} has no port (expected host:port, e.g. {address.strip('[]')}:50551; "
            f"without one gRPC would dial port 443)"
        )
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"{field}: {address!r}: port {port!r} is not a number in 1-65535 (expected host:port)")
    return address
