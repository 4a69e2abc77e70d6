"""Logging set-up shared by the CLI and the processes it spawns.

The CLI writes the chosen level to ``MX_REFIT_LOG_LEVEL``; spawned children (which start with a
fresh interpreter) call :func:`configure_child` so their logs, hook traces
(``MX_REFIT_TRACE_PLUGINS=1``) included, reach stderr the same way the parent's do.
"""

from __future__ import annotations

import logging
import os
import sys

LOG_LEVEL_ENV = "MX_REFIT_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_FORMAT = "%(levelname)s %(name)s: %(message)s"


def configure(level: str) -> None:
    """Log to stderr at ``level`` in this process and in every child it spawns."""
    level = level.upper()
    os.environ[LOG_LEVEL_ENV] = level
    if logging.getLevelName(level) > logging.INFO:
        # gRPC's C core logs failures it also raises (e.g. a port in use) straight to stderr;
        # the CLI reports them once, as one line. Must be set before grpc is imported.
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    logging.basicConfig(level=level, format=_FORMAT, stream=sys.stderr, force=True)
    _nixl_level_like_ours()


def configure_child(default: str | None = None) -> str | None:
    """In a spawned child: adopt the parent's level (or ``default``); returns the level used."""
    level = os.environ.get(LOG_LEVEL_ENV) or default
    if level:
        logging.basicConfig(level=level.upper(), format=_FORMAT, stream=sys.stderr, force=True)
    _nixl_level_like_ours()
    return level


def _nixl_level_like_ours() -> None:
    # NIXL's Python package configures its "nixl" logger with a handler on stdout when it is
    # imported; pre-set the level so its INFO chatter stays out unless asked for.
    if not os.environ.get("NIXL_LOG_LEVEL"):
        os.environ["NIXL_LOG_LEVEL"] = "WARN" if logging.getLogger().level > logging.INFO else "INFO"


def route_nixl_logs_to_stderr() -> None:
    """Point the handlers NIXL attached to its ``nixl`` logger at stderr (never stdout)."""
    for handler in logging.getLogger("nixl").handlers:
        if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) is sys.stdout:
            handler.setStream(sys.stderr)
