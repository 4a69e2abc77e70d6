"""The ``mx-refit`` command: ``demo``, ``serve`` and ``verify``."""

from __future__ import annotations

import argparse
import logging
import sys

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mx-refit", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    from mx_refit.demo import add_demo_arguments

    demo = sub.add_parser("demo", help="2 trainers -> 1 receiver refit on the embedded catalog")
    add_demo_arguments(demo)

    serve = sub.add_parser("serve", help="run the catalog as a standalone gRPC server")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    serve.add_argument("--port", type=int, default=50551, help="port (default 50551; 0 picks one)")
    serve.add_argument("--token", default=None, help="require 'authorization: Bearer TOKEN' on every call")

    # verify's arguments are a stable public contract kept next to it (imports nothing heavy)
    from mx_refit.verify.tool import add_verify_arguments

    verify = sub.add_parser("verify", help="publish an HF checkpoint from Megatron ranks and verify receivers")
    add_verify_arguments(verify)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        from mx_refit.demo import demo_main

        return demo_main(args)
    if args.command == "serve":
        from mx_refit.catalog.server import serve_forever

        serve_forever(args.host, args.port, token=args.token)
        return 0
    if args.command == "verify":
        from mx_refit.verify.tool import verify_from_args

        return verify_from_args(args)
    raise AssertionError(args.command)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
