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

from mx_refit.testing.procs import open_child, rank_arguments, serve


class MegatronRank:
    """A TP rank's process group, model and Publisher; the model is built on the first publish."""

    def __init__(self, args: argparse.Namespace) -> None:
        from mx_refit import Publisher, expected_sources, mesh_position
        from mx_refit.verify.harness import init_distributed, init_model_parallel

        init_distributed(args.rank, args.world, init_method=args.dist_init)
        init_model_parallel(tp=args.world)
        self.tp = args.world
        self.publisher = Publisher(
            args.catalog,
            args.model_name,
            mesh=mesh_position(),
            expected_sources=expected_sources(mesh=mesh_position()),  # the core's rule (= TP here)
            expected_readers=args.readers,
        )
        self.model = None

    def publish(self, version: int, hf_dir: str) -> dict:
        from mx_refit.verify.harness import build_model_from_hf

        if self.model is None:
            self.model = build_model_from_hf(hf_dir, tp=self.tp)
        else:  # an optimizer step would mutate in place; so does loading the next version
            fresh = build_model_from_hf(hf_dir, tp=self.tp)
            for mine, new in zip(self.model.model_chunks[0].parameters(), fresh.model_chunks[0].parameters(), strict=True):
                mine.data.copy_(new.data)
        state = self.publisher.publish(version, model=self.model)
        return {"state": state.value, "registrations": self.publisher.transport.registrations}

    def wait_read(self, version: int, timeout_s: float) -> None:
        self.publisher.wait_read(version, timeout_s=timeout_s)

    def stop(self) -> None:
        from mx_refit.verify.harness import destroy_distributed

        self.publisher.close()
        destroy_distributed()


def main() -> None:
    parser = rank_arguments()
    parser.add_argument("--catalog", required=True)
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--readers", type=int, required=True)
    args = parser.parse_args()
    opened = open_child(args.listen, lambda: MegatronRank(args))
    if opened is None:
        return
    conn, rank = opened
    serve(conn, {
        "publish": lambda arg: rank.publish(*arg),
        "wait_read": lambda arg: rank.wait_read(*arg),
    }, on_stop=rank.stop)


if __name__ == "__main__":
    main()
