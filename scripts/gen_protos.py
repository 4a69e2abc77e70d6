#!/usr/bin/env python3
"""Regenerate (or check) the committed gRPC/protobuf modules of the catalog.

    python scripts/gen_protos.py          # rewrite catalog_pb2.py, .pyi, _grpc.py in place
    python scripts/gen_protos.py --check  # regenerate into a temp dir; exit 1 if they differ

``protoc`` runs with ``-I core/src`` so that generated imports are absolute
(``from mx_refit.catalog.v1 import catalog_pb2``) and the output lands next to the ``.proto``.
The generated files embed the protoc/grpcio-tools version, so ``--check`` also catches a
toolchain bump that was not followed by a regeneration.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "core" / "src"
PROTOS = ("mx_refit/catalog/v1/catalog.proto",)
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generated_paths(proto: str) -> list[str]:
    """The generated files of ``proto``, relative to the source root."""
    stem = proto.removesuffix(".proto")
    return [stem + suffix for suffix in SUFFIXES]


def generate(out_dir: Path) -> None:
    """Run protoc on every proto, writing the generated modules under ``out_dir``."""
    # Imported here so that ``--help`` works without grpcio-tools installed.
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    for proto in PROTOS:
        args = [
            "grpc_tools.protoc",
            f"-I{SRC}",
            f"-I{well_known}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(SRC / proto),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {proto}")


def check() -> list[str]:
    """Regenerate into a temporary directory; return the committed files that differ."""
    stale = []
    with tempfile.TemporaryDirectory(prefix="mx-refit-protos-") as tmp:
        generate(Path(tmp))
        for proto in PROTOS:
            for rel in generated_paths(proto):
                committed, fresh = SRC / rel, Path(tmp) / rel
                if not committed.exists() or not filecmp.cmp(committed, fresh, shallow=False):
                    stale.append(rel)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit non-zero if the committed generated files are not current",
    )
    args = parser.parse_args(argv)
    if args.check:
        stale = check()
        if stale:
            print("stale generated protobuf modules (run scripts/gen_protos.py):", file=sys.stderr)
            for rel in stale:
                print(f"  core/src/{rel}", file=sys.stderr)
            return 1
        print("generated protobuf modules are current")
        return 0
    generate(SRC)
    for proto in PROTOS:
        for rel in generated_paths(proto):
            print(f"wrote core/src/{rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
