"""One rank of a plain PyTorch DTensor trainer whose vLLM RL client is ``DynamoRefitClient``.

transformers' ``Qwen2ForCausalLM`` with DTensor parameters over a gloo mesh (matrices
``Shard(0)``, o_proj/down_proj ``Shard(1)``, vectors replicated), vLLM's ``ModuleSource``,
``WeightTransferTrainerFactory.trainer_init(MxTrainerInitInfo, client=DynamoRefitClient(...))``:
the trainer engine of the vLLM plugin drives Dynamo workers without knowing it.

Protocol: ``("send", (version, hf_dir))``; ``("stop", None)``.
"""

from __future__ import annotations


from mx_refit.testing.procs import open_child, rank_arguments, serve


class DTensorRank:
    def __init__(self, rank: int, world: int, dist_init: str, catalog: str, model_name: str, urls: list[str], hf_dir: str):
        import torch
        import torch.distributed as dist
        import transformers
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        from vllm.distributed.weight_transfer import ModuleSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from mx_refit_dynamo import DynamoRefitClient
        from mx_refit_vllm.trainer import MxTrainerInitInfo

        dist.init_process_group("gloo", init_method=dist_init, rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        config = transformers.AutoConfig.from_pretrained(hf_dir)
        self.module = transformers.Qwen2ForCausalLM(config).to(torch.float32)
        self.placements = {}
        for name, param in list(self.module.named_parameters()):
            if param.dim() == 1:
                placement = Replicate()
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                placement = Shard(1)
            else:
                placement = Shard(0)
            owner, leaf = name.rsplit(".", 1)
            tensor = distribute_tensor(param.detach().clone(), mesh, (placement,))
            setattr(self.module.get_submodule(owner), leaf, torch.nn.Parameter(tensor, requires_grad=False))
            self.placements[name] = placement
        if config.tie_word_embeddings:
            self.module.lm_head.weight = self.module.model.embed_tokens.weight
        info = MxTrainerInitInfo(
            catalog=catalog, model=model_name, world_size=world, rank=rank, ready_timeout_s=120.0, drain_timeout_s=120.0
        )
        self.client = DynamoRefitClient(urls, timeout_s=300.0)
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=ModuleSource(self.module))
        self.rank, self.world = rank, world

    def send(self, version: int, hf_dir: str) -> dict:
        import torch

        from mx_refit.testing.checkpoints import load_version

        full = load_version(hf_dir)
        for name, param in self.module.named_parameters():
            want = full[name]
            dim = getattr(self.placements[name], "dim", None)
            if dim is not None:
                want = torch.chunk(want, self.world, dim=dim)[self.rank]
            param.to_local().copy_(want)  # in place, as an optimizer step would
        self.engine.send_weights(version)
        return {"registrations": self.engine.publisher.transport.registrations}


def main() -> None:
    parser = rank_arguments()
    parser.add_argument("--catalog", required=True)
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--workers", required=True, help="comma-separated Dynamo system URLs")
    parser.add_argument("--hf-dir", required=True)
    args = parser.parse_args()
    opened = open_child(args.listen, lambda: DTensorRank(
        args.rank, args.world, args.dist_init, args.catalog, args.model_name, args.workers.split(","), args.hf_dir
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
