"""NeMo RL refit on CPU: the mx engine vs NeMo RL's gathered HF-export path, same model, same ranks.

Two Megatron-Core TP ranks (real megatron-core + Megatron-Bridge, gloo) hold a Qwen2-shaped model.
Per refit cycle, trainer side, measured on every rank:

- **gathered HF export** (what NeMo RL's NCCL broadcast and NIXL checkpoint engine do on the
  trainer, ``megatron_policy_worker.py:2350`` feeding ``split_weight_chunks``,
  ``utils/checkpoint_engines/base.py``): every rank runs Bridge's ``export_hf_weights`` to the
  end (TP all-gathers + conversion to HF) and copies each tensor into a transfer bucket. The
  send itself (NCCL/NIXL) is not counted: this is a lower bound of that path's trainer time.
- **mx engine** (``MxCheckpointEngine.send_weights``): the export generator is closed unstarted,
  the previous version retired, the native shards published in place. A receiver in the parent
  (TP1, whole HF tensors) then pulls the version over NIXL straight from the ranks' memory;
  its time and bytes are reported separately (that work is off the trainer).

Usage: ``python benchmarks/bench_nemo_rl_refit.py [--hidden 512 --layers 4 --cycles 4] [--json]``
(core venv; ``plugins/nemo_rl/src`` importable).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins" / "nemo_rl" / "src"))


def write_checkpoint(out: Path, hidden: int, layers: int, vocab: int) -> Path:
    import torch
    import transformers
    from safetensors.torch import save_file

    config = transformers.Qwen2Config(
        hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=128,
        tie_word_embeddings=False, torch_dtype="float32", use_sliding_window=False,
    )
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in transformers.Qwen2ForCausalLM(config).named_parameters()}
    gen = torch.Generator().manual_seed(0)
    save_file({n: torch.randn(s, generator=gen) * 0.02 for n, s in shapes.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config.architectures = ["Qwen2ForCausalLM"]
    config.save_pretrained(out)
    return out


class PolicyWorker:
    """What the engine reads from NeMo RL's Megatron policy worker."""

    def __init__(self, rank: int, model: Any, bridge: Any) -> None:
        self.rank, self.model, self.megatron_bridge, self.cfg, self.draft_model = rank, model, bridge, {}, None
        self.refit_conversion_tasks = [t for t in bridge.get_conversion_tasks([model]) if t is not None]

    def _iter_params_with_optional_kv_scales(self, kv_scales: Any = None):
        yield from self.megatron_bridge.export_hf_weights(
            [self.model], show_progress=False, conversion_tasks=self.refit_conversion_tasks)


def rank_main(rank: int, world: int, init_method: str, hf_dir: str, address: str, model_name: str, cycles: int,
              published: Any, pulled: Any) -> dict[str, Any]:
    import asyncio

    import torch
    import torch.distributed as dist
    from mx_refit_nemo_rl.engine import MxCheckpointEngine

    from mx_refit.verify.harness import build_model_from_hf, init_distributed, init_model_parallel

    init_distributed(rank, world, init_method=init_method)
    init_model_parallel(tp=world)
    bridged = build_model_from_hf(hf_dir, tp=world)
    worker = PolicyWorker(rank, bridged.model_chunks[0], bridged.bridge)
    local_bytes = sum(p.numel() * p.element_size() for p in worker.model.parameters())

    # Gathered HF export into a transfer bucket, as NeMo RL's engines feed their buckets.
    bucket = torch.empty(64 << 20, dtype=torch.uint8)
    gathered_s, exported_bytes = [], 0
    for _ in range(cycles):
        dist.barrier()
        started = time.perf_counter()
        exported_bytes = 0
        for _name, tensor in worker._iter_params_with_optional_kv_scales():
            flat = tensor.contiguous().view(-1).view(torch.uint8)
            for offset in range(0, flat.numel(), bucket.numel()):
                chunk = flat[offset: offset + bucket.numel()]
                bucket[: chunk.numel()].copy_(chunk)
            exported_bytes += flat.numel()
        gathered_s.append(time.perf_counter() - started)

    engine = MxCheckpointEngine(bucket_size=64 << 20, weight_sync={
        "model_name": model_name, "catalog": {"mode": "standalone", "address": address}})
    engine.policy_worker = worker
    engine.prepare()
    engine.init_policy_process_group(worker_rank=rank, train_world_size=world, rollout_world_size=1, metadata=[])
    mx_s, registrations = [], []
    for cycle in range(1, cycles + 1):
        dist.barrier()
        started = time.perf_counter()
        asyncio.run(engine.send_weights(worker._iter_params_with_optional_kv_scales()))
        mx_s.append(time.perf_counter() - started)
        registrations.append(engine.last_send.new_registrations)
        published.put((rank, cycle))
        assert pulled.get(timeout=300) == cycle
    engine.finalize()
    return {"rank": rank, "local_bytes": local_bytes, "exported_bytes": exported_bytes, "gathered_s": gathered_s,
            "mx_s": mx_s, "mx_new_registrations": registrations}


def wait_for(channel: Any, results: dict[str, Any]) -> Any:
    """The next message on ``channel``, surfacing a rank failure instead of waiting forever."""
    import queue

    while "error" not in results:
        try:
            return channel.get(timeout=1.0)
        except queue.Empty:
            pass
    raise results["error"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--cycles", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import multiprocessing as mp

    import mx_refit
    from mx_refit.types import TargetLayout
    from mx_refit.verify.harness import launch_ranks

    server = mx_refit.start_catalog()
    model_name = "bench-nemo-rl"
    manager = mp.get_context("spawn").Manager()
    published, pulled = manager.Queue(), manager.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = write_checkpoint(Path(tmp), args.hidden, args.layers, args.vocab)
        results: dict[str, Any] = {}

        def run() -> None:
            try:
                results["ranks"] = launch_ranks(rank_main, args.tp, str(hf_dir), server.address, model_name,
                                                args.cycles, published, pulled, timeout_s=1800)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
                results["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        receiver = mx_refit.Receiver(server.address, model_name, target=TargetLayout(full_tensors=True))
        pulls = []
        for cycle in range(1, args.cycles + 1):
            for _ in range(args.tp):
                wait_for(published, results)
            started = time.perf_counter()
            refit = receiver.refit(version=cycle)
            pulls.append({"seconds": time.perf_counter() - started, "pull_s": refit.stats.seconds,
                          "bytes_pulled": refit.stats.bytes_pulled, "new_registrations": refit.stats.new_registrations,
                          "tensors": refit.stats.tensors})
            for _ in range(args.tp):
                pulled.put(cycle)
        thread.join()
        receiver.close()
        server.stop()
    if "error" in results:
        raise results["error"]
    ranks = results["ranks"]
    steady = slice(1, None)  # cycle 1 pays connection set-up and the first registration
    gathered = max(statistics.median(r["gathered_s"][steady]) for r in ranks)
    mx = max(statistics.median(r["mx_s"][steady]) for r in ranks)
    summary = {
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "tp": args.tp,
                  "hf_bytes": ranks[0]["exported_bytes"]},
        "trainer_s_gathered_export": gathered,
        "trainer_s_mx": mx,
        "speedup": gathered / mx,
        "trainer_bytes_materialised_per_rank_gathered": ranks[0]["exported_bytes"],
        "trainer_bytes_materialised_per_rank_mx": 0,
        "trainer_bytes_published_in_place_per_rank": [r["local_bytes"] for r in ranks],
        "receiver_pull": pulls,
        "ranks": ranks,
    }
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"model: {summary['model']}")
        print(f"trainer side, per refit (median of cycles 2..{args.cycles}, slowest rank):")
        print(f"  gathered HF export + bucket copy: {gathered * 1e3:8.1f} ms, {ranks[0]['exported_bytes'] / 1e6:.1f} MB "
              "of full HF tensors materialised on every rank")
        print(f"  mx engine send_weights:           {mx * 1e3:8.1f} ms, 0 B gathered or copied "
              f"(ratio {gathered / mx:.1f}x)")
        print(f"  mx new registrations per cycle:   {[r['mx_new_registrations'] for r in ranks]}")
        print("receiver (off the trainer), per cycle: " + ", ".join(
            f"{p['seconds'] * 1e3:.0f} ms / {p['bytes_pulled'] / 1e6:.1f} MB" for p in pulls))


if __name__ == "__main__":
    main()
