"""Generated protobuf/gRPC modules of the catalog API, version 1 (see ``catalog.proto``).

Regenerate with ``python scripts/gen_protos.py``; never edit the ``*_pb2*`` files by hand.
"""
