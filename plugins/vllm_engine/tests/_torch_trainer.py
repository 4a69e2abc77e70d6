"""One rank of a plain PyTorch trainer using vLLM's RL API with the ``mx`` backend.

The model is transformers' own ``Qwen2ForCausalLM`` whose parameters are DTensors over a gloo
device mesh of all trainer ranks: matrices ``Shard(0)`` (uneven: vocab 131 over 2 ranks) or
``Shard(1)`` (o_proj, down_proj), vectors replicated. ``ModuleSource`` (vLLM's) describes it;
``WeightTransferTrainerFactory.trainer_init`` builds our engine from ``MxTrainerInitInfo``; the
client is vLLM's ``HTTPVLLMWeightSyncClient`` talking to the test's relay of vLLM's RL routes.

Protocol: ``("send", (version, hf_dir))`` copies version ``hf_dir``'s weights into the local
shards in place, then ``send_weights(version)``; ``("stop", None)``.
"""

from __future__ import annotations


from mx_refit.testing.procs import open_child, rank_arguments, serve


class TrainerRank:
    def __init__(
        self, rank: int, world: int, dist_init: str, catalog: str, model_name: str, relay: str, hf_dir: str,
        staged: bool = True,
    ) -> None:
        import torch
        import torch.distributed as dist
        import transformers
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from mx_refit_vllm.trainer import MxTrainerInitInfo

        dist.init_process_group(
            "gloo", init_method=dist_init, rank=rank, world_size=world
        )
        self.mesh = init_device_mesh("cpu", (world,))
        config = transformers.AutoConfig.from_pretrained(hf_dir)
        torch.manual_seed(0)
        self.module = transformers.Qwen2ForCausalLM(config).to(torch.float32)
        self.placements: dict[str, tuple] = {}
        for name, param in list(self.module.named_parameters()):
            if param.dim() == 1:
                placement = (Replicate(),)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                placement = (Shard(1),)
            else:
                placement = (Shard(0),)
            owner, leaf = self.module.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
            dt = distribute_tensor(param.detach().clone(), self.mesh, placement)
            setattr(owner, leaf, torch.nn.Parameter(dt, requires_grad=False))
            self.placements[name] = placement
        if config.tie_word_embeddings:  # keep lm_head tied to the (now distributed) embedding
            self.module.lm_head.weight = self.module.model.embed_tokens.weight
        self.source = ModuleSource(self.module)
        info = MxTrainerInitInfo(
            catalog=catalog,
            model=model_name,
            world_size=world,
            rank=rank,
            ready_timeout_s=120.0,
            drain_timeout_s=120.0,
            worker={"load_batch_bytes": 64 << 10},
            staged=staged,
        )
        self.engine = WeightTransferTrainerFactory.trainer_init(
            info, client=HTTPVLLMWeightSyncClient(relay, timeout=300), source=self.source
        )
        self.world = world
        self.rank = rank

    def send(self, version: int, hf_dir: str) -> dict:
        """Write version ``hf_dir`` into this rank's shards in place (as an optimizer would), then send."""
        import torch

        from mx_refit.testing.checkpoints import load_version

        full = load_version(hf_dir)
        pointers = {}
        for name, param in self.module.named_parameters():
            local = param.to_local()
            (placement,) = self.placements[name]
            want = full[name]
            if hasattr(placement, "dim"):
                want = torch.chunk(want, self.world, dim=placement.dim)[self.rank]
            local.copy_(want)
            pointers[name] = local.data_ptr()
        self.engine.send_weights(version)
        return {"pointers": pointers, "registrations": self.engine.publisher.transport.registrations}


def main() -> None:
    parser = rank_arguments()
    parser.add_argument("--catalog", required=True)
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--relay", required=True)
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--load", action="store_true", help="MxTrainerInitInfo(staged=False)")
    args = parser.parse_args()
    opened = open_child(args.listen, lambda: TrainerRank(
        args.rank, args.world, args.dist_init, args.catalog, args.model_name, args.relay, args.hf_dir,
        staged=not args.load,
    ))
    if opened is None:
        return
    conn, rank = opened

    def stop() -> None:
        import torch.distributed as dist

        rank.engine.shutdown()
        dist.destroy_process_group()

    serve(conn, {"send": lambda arg: rank.send(*arg)}, on_stop=stop)


if __name__ == "__main__":
    main()
