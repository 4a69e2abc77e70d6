"""One Megatron-Core TP rank publishing through mx-refit's front door (core venv's Python).

A trainer without a central driver: each rank publishes its native shards in place
(``Publisher.publish(version, model=BridgedModel)``, the built-in Megatron plugin collects
them), announcing how many readers will read each version, and before it would mutate its
buffers waits until every one of them completed a read (``Publisher.wait_read``).

Protocol: ``("publish", (version, hf_dir))`` -> ``{"state", "registrations"}``;
``("wait_read", (version, timeout_s))``; ``("stop", None)``.
"""

from __future__ import annotations

import argparse
import os
import traceback
from multiprocessing.connection import Client


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--dist-port", type=int, required=True)
    parser.add_argument("--catalog", required=True)
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--readers", type=int, required=True)
    args = parser.parse_args()
    host, port = args.listen.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["MX_TEST_AUTHKEY"]))
    try:
        from mx_refit import Publisher, mesh_position
        from mx_refit.verify.harness import (
            build_model_from_hf,
            destroy_distributed,
            init_distributed,
            init_model_parallel,
        )

        init_distributed(args.rank, args.world, master_port=args.dist_port)
        init_model_parallel(tp=args.world)
        publisher = Publisher(
            args.catalog,
            args.model_name,
            mesh=mesh_position(),
            expected_sources=args.world,
            expected_readers=args.readers,
        )
    except BaseException:
        conn.send(("err", ("StartupError", traceback.format_exc())))
        return
    conn.send(("ok", {"pid": os.getpid()}))
    model = None
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            publisher.close()
            destroy_distributed()
            conn.send(("ok", None))
            break
        try:
            if cmd == "publish":
                version, hf_dir = arg
                if model is None:
                    model = build_model_from_hf(hf_dir, tp=args.world)
                else:  # an optimizer step would mutate in place; so does loading the next version
                    fresh = build_model_from_hf(hf_dir, tp=args.world)
                    for mine, new in zip(model.model_chunks[0].parameters(), fresh.model_chunks[0].parameters(), strict=True):
                        mine.data.copy_(new.data)
                state = publisher.publish(version, model=model)
                conn.send(("ok", {"state": state.value, "registrations": publisher.transport.registrations}))
            elif cmd == "wait_read":
                version, timeout_s = arg
                publisher.wait_read(version, timeout_s=timeout_s)
                conn.send(("ok", None))
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except BaseException as exc:
            conn.send(("err", (type(exc).__name__, f"{exc}\n{traceback.format_exc()}")))


if __name__ == "__main__":
    main()
