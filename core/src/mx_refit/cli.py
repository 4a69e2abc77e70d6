"""The ``mx-refit`` command: ``demo``, ``serve``, ``verify`` and ``plugins``.

Every failure ends as one line on stderr, ``mx-refit: error: <cause>``, and a documented exit
code (:data:`EXIT_CODES`). With ``--json`` stdout carries exactly one JSON document: everything
else (logs, NIXL/UCX output, child processes) goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any, NoReturn

__all__ = ["EXIT_CODES", "build_parser", "main"]

EXIT_OK = 0
EXIT_DIFFERENCES = 1
EXIT_USAGE = 2
EXIT_MISSING_EXTRA = 3
EXIT_FAILURE = 4
EXIT_INTERRUPTED = 130

EXIT_CODES = {
    EXIT_OK: "success",
    EXIT_DIFFERENCES: "the run finished but found mismatched or missing tensors (demo, verify)",
    EXIT_USAGE: "usage or configuration error: a bad flag or value, a bad path, a failed preflight check, "
    "an unknown plugin",
    EXIT_MISSING_EXTRA: "an optional dependency is missing; the message names the extra to install",
    EXIT_FAILURE: "runtime failure: port in use, catalog unreachable, a child process died, a transfer "
    "failed or timed out",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}

log = logging.getLogger("mx_refit.cli")


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's one-line error format."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"mx-refit: error: {self.prog.removeprefix('mx-refit ')}: {message} "
                              f"(see `{self.prog} --help`)\n")


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is out of range (0-65535; 0 picks a free port)")
    return port


def _common_options(suppress: bool) -> _Parser:
    """Options accepted before and after the sub-command (``--log-level`` anywhere)."""
    default = argparse.SUPPRESS if suppress else None
    common = _Parser(add_help=False)
    from mx_refit._logsetup import LEVELS

    common.add_argument("--log-level", type=str.upper, choices=LEVELS, default=default,
                        help="log level for this process and the processes it starts (default WARNING)")
    common.add_argument("-v", "--verbose", action="store_true", default=default or False,
                        help="same as --log-level INFO")
    return common


def build_parser() -> argparse.ArgumentParser:
    from mx_refit import __version__

    epilog = "exit codes:\n" + "\n".join(f"  {code:<4}{meaning}" for code, meaning in EXIT_CODES.items())
    parser = _Parser(prog="mx-refit", description=__doc__.split("\n\n")[0], parents=[_common_options(False)],
                     epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"mx-refit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,serve,verify,plugins}")
    common = [_common_options(True)]

    from mx_refit.demo import add_demo_arguments

    demo = sub.add_parser("demo", parents=common, help="2 trainers -> 1 receiver refit on the embedded catalog")
    add_demo_arguments(demo)

    serve = sub.add_parser("serve", parents=common, help="run the catalog as a standalone gRPC server")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    serve.add_argument("--port", type=_port, default=50551, help="port (default 50551; 0 picks one)")
    token = serve.add_mutually_exclusive_group()
    token.add_argument("--token-file", metavar="PATH", default=None,
                       help="require 'authorization: Bearer TOKEN' on every call, TOKEN read from PATH")
    token.add_argument("--token", default=None,
                       help="the token on the command line (visible in `ps`; prefer MX_REFIT_TOKEN or --token-file)")
    serve.add_argument("--metrics-port", type=_port, default=None,
                       help="also serve Prometheus metrics on this port (needs `mx-refit[metrics]`)")
    serve.add_argument("--store", default="memory", metavar="URL",
                       help="where the catalog keeps its state: memory (default) or redis://HOST:PORT/DB "
                            "(kept across restarts, shared by several serve processes; needs `mx-refit[redis]`)")
    serve.add_argument("--no-express", dest="express", action="store_false",
                       help="serve no express lane (readers then make their lease calls over gRPC)")
    serve.add_argument("--json", action="store_true", help="print where it listens as one JSON line")

    # verify's arguments are a stable public contract kept next to it (imports nothing heavy)
    from mx_refit.verify.tool import add_verify_arguments

    verify = sub.add_parser("verify", parents=common,
                            help="publish an HF checkpoint from Megatron ranks and verify receivers")
    add_verify_arguments(verify)

    plugins = sub.add_parser("plugins", parents=common, help="list the plugins that load and the hooks each implements")
    plugins.add_argument("--json", action="store_true", help="print one JSON list")
    return parser


@contextlib.contextmanager
def _stdout_reserved_for_json() -> Iterator[None]:
    """Python-level ``print`` keeps the real stdout; file descriptor 1 (C libraries, and every
    child process, which inherits it) is pointed at stderr, so stdout carries only the JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    real_stdout = sys.stdout
    sys.stdout = os.fdopen(os.dup(saved), "w", buffering=1)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stdout.close()
        sys.stdout = real_stdout
        os.dup2(saved, 1)
        os.close(saved)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    first, _, _ = text.partition("\nTraceback")  # child reports carry their traceback after the cause
    return " | ".join(line.strip() for line in first.splitlines() if line.strip())


def _error(message: str, code: int) -> int:
    print(f"mx-refit: error: {message}", file=sys.stderr, flush=True)
    return code


def _sigterm_interrupts() -> None:
    """SIGTERM ends ``demo`` and ``verify`` like Ctrl-C: their cleanup stops the child processes
    (the default action killed only this one, and the children ran on)."""
    import signal

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def _run(args: argparse.Namespace) -> int:
    if args.command in ("demo", "verify"):
        _sigterm_interrupts()
    if args.command == "demo":
        from mx_refit.demo import demo_main

        return demo_main(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "verify":
        from mx_refit.verify.tool import verify_from_args

        return verify_from_args(args)
    if args.command == "plugins":
        return _plugins(args)
    raise AssertionError(args.command)


def _serve(args: argparse.Namespace) -> int:
    import json

    from mx_refit.catalog.server import serve_forever
    from mx_refit.catalog.store import check_store_url
    from mx_refit.errors import InvalidArgument

    check_store_url(args.store, "--store")

    token = args.token
    if args.token_file:
        try:
            with open(args.token_file) as handle:
                token = handle.read().strip()
        except OSError as exc:
            raise InvalidArgument(f"--token-file {args.token_file!r}: {exc.strerror or exc}") from None
        if not token:
            raise InvalidArgument(f"--token-file {args.token_file!r} is empty")
    elif token is None:
        token = os.environ.get("MX_REFIT_TOKEN") or None

    def announce(info: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps(info), flush=True)
        else:
            metrics = f"; metrics on {info['metrics']}" if info["metrics"] else ""
            auth = "bearer token required" if info["token"] else "no token"
            lane = f"express lane on port {info['express_port']}" if info["express_port"] else "no express lane"
            print(f"mx-refit catalog listening on {info['address']} ({auth}; gRPC health service on; "
                  f"{lane}; store {info['store']}){metrics}", flush=True)

    serve_forever(args.host, args.port, token=token, metrics_port=args.metrics_port, on_listening=announce,
                  store=args.store, express=args.express)
    return EXIT_OK


def _plugins(args: argparse.Namespace) -> int:
    import json

    from mx_refit.plugins import Hooks

    listing = Hooks().describe()
    if args.json:
        print(json.dumps(listing))
        return EXIT_OK
    for entry in listing:
        if entry["distribution"]:
            origin = f"{entry['distribution']} {entry['version']}"
        else:
            origin = "built-in" if entry["builtin"] else "registered in-process"
        print(f"{entry['name']} ({origin}): {', '.join(entry['hooks']) or 'no hooks'}")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (see :data:`EXIT_CODES`)."""
    args = build_parser().parse_args(argv)
    from mx_refit._logsetup import configure

    configure(args.log_level or ("INFO" if args.verbose else "WARNING"))
    from mx_refit.errors import InvalidArgument, MxRefitError, NotFound, missing_extra
    from mx_refit.plugins import PluginLoadError

    guard = _stdout_reserved_for_json() if getattr(args, "json", False) else contextlib.nullcontext()
    try:
        with guard:
            return _run(args)
    except KeyboardInterrupt:
        return _error("interrupted", EXIT_INTERRUPTED)
    except ImportError as exc:
        extra = missing_extra(exc)
        if extra is None:
            log.debug("import failed", exc_info=True)
            return _error(f"cannot import {exc.name or ''}: {_one_line(exc)}", EXIT_FAILURE)
        return _error(_one_line(extra), EXIT_MISSING_EXTRA)
    except (InvalidArgument, NotFound, PluginLoadError) as exc:
        return _error(_one_line(exc), EXIT_USAGE)
    except (MxRefitError, OSError, RuntimeError, TimeoutError) as exc:
        log.debug("command failed", exc_info=True)
        return _error(_one_line(exc), EXIT_FAILURE)
    except Exception as exc:  # a bug: still one line; the traceback is a --log-level DEBUG away
        log.debug("unexpected error", exc_info=True)
        return _error(f"unexpected {type(exc).__name__}: {_one_line(exc)} (--log-level DEBUG shows the traceback)",
                      EXIT_FAILURE)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
