"""One Megatron-Core trainer rank, run by the CORE venv's Python (megatron-core + Megatron-Bridge
are not installable next to vLLM 0.33: their transformers pins conflict).

The rank builds a real Megatron GPT model from an HF checkpoint through Megatron-Bridge at the
requested TP (gloo), collects its native shards in place with mx-refit's Megatron collector
(fused QKV, [gate_r; up_r] fc1, padded vocab) plus the sidecar, and publishes them. The vLLM side
never sees Megatron code: it plans from the catalog's descriptors and sidecar alone.

Protocol: ``("publish", (version, hf_dir[, model_name]))`` (another model name gets its own
Publisher in the same process group); ``("drain", version)``; ``("stop", None)``.
"""

from __future__ import annotations

import argparse

from mx_refit.testing.procs import open_child, rank_arguments, serve


class MegatronTrainer:
    """A TP rank's process group and Publisher; every published model stays alive until drained."""

    def __init__(self, args: argparse.Namespace) -> None:
        from mx_refit.verify.harness import init_distributed, init_model_parallel

        init_distributed(args.rank, args.world, init_method=args.dist_init)
        init_model_parallel(tp=args.world)
        self.tp = args.world
        self.catalog, self.model_name = args.catalog, args.model_name
        self.publishers = {args.model_name: self._publisher(args.model_name)}
        self.publisher = self.publishers[args.model_name]
        self.keep: list[object] = []

    def _publisher(self, model_name: str):  # type: ignore[no-untyped-def]
        from mx_refit.megatron.parallel import expected_sources, mesh_position
        from mx_refit.publisher import Publisher

        mesh = mesh_position()
        return Publisher(self.catalog, model_name, mesh=mesh, expected_sources=expected_sources(mesh=mesh))

    def publish(self, version: int, hf_dir: str, model_name: str | None = None) -> dict:
        from mx_refit.megatron.collect import collect_for_publish
        from mx_refit.verify.harness import build_model_from_hf

        name = model_name or self.model_name
        if name not in self.publishers:
            self.publishers[name] = self._publisher(name)
        bridged = build_model_from_hf(hf_dir, tp=self.tp)
        tensors, sidecar = collect_for_publish(bridged.bridge, bridged.model, hf_config=bridged.hf_config)
        self.keep.append(bridged)
        state = self.publishers[name].publish(version, tensors, sidecar=sidecar)
        return {"state": state.value, "tensors": len(tensors)}

    def drain(self, version: int) -> None:
        self.publisher.wait_drained(version, timeout_s=60)

    def stop(self) -> None:
        from mx_refit.verify.harness import destroy_distributed

        for publisher in self.publishers.values():
            publisher.close()
        destroy_distributed()


def main() -> None:
    parser = rank_arguments()
    parser.add_argument("--catalog", required=True)
    parser.add_argument("--model-name", required=True)
    args = parser.parse_args()
    opened = open_child(args.listen, lambda: MegatronTrainer(args))
    if opened is None:
        return
    conn, trainer = opened
    serve(conn, {"publish": lambda arg: trainer.publish(*arg), "drain": trainer.drain}, on_stop=trainer.stop)


if __name__ == "__main__":
    main()
