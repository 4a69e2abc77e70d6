"""One Megatron-Core trainer rank, run by the CORE venv's Python (megatron-core + Megatron-Bridge
are not installable next to vLLM 0.33: their transformers pins conflict).

The rank builds a real Megatron GPT model from an HF checkpoint through Megatron-Bridge at the
requested TP (gloo), collects its native shards in place with mx-refit's Megatron collector
(fused QKV, [gate_r; up_r] fc1, padded vocab) plus the sidecar, and publishes them. The vLLM side
never sees Megatron code: it plans from the catalog's descriptors and sidecar alone.

Protocol: ``("publish", (version, hf_dir))``; ``("drain", version)``; ``("stop", None)``.
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
    args = parser.parse_args()
    host, port = args.listen.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["MX_TEST_AUTHKEY"]))
    try:
        from mx_refit.megatron.collect import collect_for_publish
        from mx_refit.megatron.parallel import mesh_position
        from mx_refit.verify.harness import build_model_from_hf, init_distributed, init_model_parallel
        from mx_refit.publisher import Publisher

        init_distributed(args.rank, args.world, master_port=args.dist_port)
        init_model_parallel(tp=args.world)
        publisher = Publisher(
            args.catalog, args.model_name, mesh=mesh_position(), expected_sources=args.world
        )
    except BaseException:
        conn.send(("err", ("StartupError", traceback.format_exc())))
        return
    conn.send(("ok", {"pid": os.getpid()}))
    keep = []  # published models stay alive until drained
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            from mx_refit.verify.harness import destroy_distributed

            publisher.close()
            destroy_distributed()
            conn.send(("ok", None))
            break
        try:
            if cmd == "publish":
                version, hf_dir = arg
                bridged = build_model_from_hf(hf_dir, tp=args.world)
                tensors, sidecar = collect_for_publish(
                    bridged.bridge, bridged.model, hf_config=bridged.hf_config
                )
                keep.append(bridged)
                state = publisher.publish(version, tensors, sidecar=sidecar)
                conn.send(("ok", {"state": state.value, "tensors": len(tensors)}))
            elif cmd == "drain":
                publisher.wait_drained(arg, timeout_s=60)
                conn.send(("ok", None))
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except BaseException as exc:
            conn.send(("err", (type(exc).__name__, f"{exc}\n{traceback.format_exc()}")))


if __name__ == "__main__":
    main()
