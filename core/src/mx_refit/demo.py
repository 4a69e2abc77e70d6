"""`mx-refit demo`: a real multi-process refit on the embedded catalog.

With ``--model HF_DIR`` the demo is a real Megatron refit instead (see :func:`megatron_demo`).

Two trainer processes each own half of a synthetic Llama-shaped model (~310 MB of bf16) and
publish it in place; one receiver process pulls every tensor each cycle (over NIXL, or over CUDA
IPC when the trainers' GPU memory is on the same node: on one GPU all three share it, colocated,
and the demo reports the path it used) and checks it
byte for byte against the values the trainers were told to write. The weights change in place
between cycles, after the trainers waited for the previous version to drain.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import sys
import time
from typing import Any

from mx_refit.checks import AUTO, TRANSPORT_MODES

__all__ = ["add_demo_arguments", "demo_main", "synthetic_llama"]

MODEL_NAME = "demo-llama"
# The demo's wiring is sequential, so a step that takes longer than this is broken, not slow.
STEP_TIMEOUT_S = 600.0


def synthetic_llama(
    layers: int = 8, hidden: int = 1024, heads: int = 16, kv_heads: int = 4, ffn: int = 2816, vocab: int = 32000
) -> list[tuple[str, tuple[int, ...]]]:
    """HF-style Llama parameter names and shapes (untied embeddings, GQA)."""
    head_dim = hidden // heads
    spec: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        spec += [
            (f"{p}.input_layernorm.weight", (hidden,)),
            (f"{p}.self_attn.q_proj.weight", (heads * head_dim, hidden)),
            (f"{p}.self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
            (f"{p}.self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
            (f"{p}.self_attn.o_proj.weight", (hidden, heads * head_dim)),
            (f"{p}.post_attention_layernorm.weight", (hidden,)),
            (f"{p}.mlp.gate_proj.weight", (ffn, hidden)),
            (f"{p}.mlp.up_proj.weight", (ffn, hidden)),
            (f"{p}.mlp.down_proj.weight", (hidden, ffn)),
        ]
    spec += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return spec


def _owner_split(spec: list[tuple[str, tuple[int, ...]]], ranks: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Greedy by size, so each trainer owns about the same number of bytes."""
    import math

    owned: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for name, shape in sorted(spec, key=lambda item: -math.prod(item[1])):
        r = load.index(min(load))
        owned[r].append((name, shape))
        load[r] += math.prod(shape)
    return owned


def fill_pattern(tensor: Any, name: str, cycle: int) -> None:
    """Deterministic, cycle-dependent bytes (cheap to regenerate for the byte check)."""
    import zlib

    import torch

    seed = (zlib.crc32(name.encode()) ^ (cycle * 0x9E3779B1)) & 0x7FFFFFFF
    flat = tensor.view(-1).view(torch.int16)
    idx = torch.arange(flat.numel(), dtype=torch.int32, device=tensor.device)
    flat.copy_((idx * 1103515245 + seed).bitwise_right_shift(8).to(torch.int16))


def _trainer(rank: int, ranks: int, address: str, device: str, commands: Any, results: Any,
             transport: str = "auto") -> None:
    try:
        import math

        import torch

        from mx_refit._logsetup import configure_child
        from mx_refit.publisher import Publisher
        from mx_refit.types import MeshPosition, PublishedTensor

        configure_child()
        dev = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if device == "cuda" else "cpu")
        owned = _owner_split(synthetic_llama(), ranks)[rank]
        # One flat buffer with a view per parameter, as Megatron's DDP keeps them: one region to
        # register, and neighbouring tensors coalesce into one NIXL descriptor.
        flat = torch.empty(sum(math.prod(shape) for _, shape in owned), dtype=torch.bfloat16, device=dev)
        tensors, offset = {}, 0
        for name, shape in owned:
            tensors[name] = flat[offset : offset + math.prod(shape)].view(shape)
            offset += math.prod(shape)
        publisher = Publisher(
            # Each trainer owns a disjoint half of the tensors, like a pipeline stage.
            address, MODEL_NAME, mesh=MeshPosition(pp_rank=rank, pp_size=ranks), expected_sources=ranks,
            source_id=f"{MODEL_NAME}/trainer{rank}", transport_mode=transport,
        )
        results.put(("ready", rank, None))
        while True:
            command, cycle = commands.get(timeout=STEP_TIMEOUT_S)
            if command == "stop":
                break
            if cycle > 1:
                publisher.wait_drained(cycle - 1)  # nobody reads cycle-1 any more: safe to mutate
            for name, tensor in tensors.items():
                fill_pattern(tensor, name, cycle)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            publisher.publish(cycle, [PublishedTensor(name, t) for name, t in tensors.items()])
            results.put(("published", rank, {"registrations": publisher.transport.registrations}))
        publisher.close()
    except BaseException as exc:  # report, never hang the parent
        results.put(("error", rank, f"trainer {rank}: {type(exc).__name__}: {exc}"))


def _receiver(address: str, device: str, commands: Any, results: Any, transport: str = "auto") -> None:
    try:
        import torch

        from mx_refit._logsetup import configure_child
        from mx_refit.receive.receiver import Receiver

        configure_child()
        dev = f"cuda:{torch.cuda.device_count() - 1}" if device == "cuda" else "cpu"
        receiver = Receiver(address, MODEL_NAME, device=dev, transport_mode=transport)
        expected = {}
        results.put(("ready", "receiver", None))
        while True:
            command, cycle = commands.get(timeout=STEP_TIMEOUT_S)
            if command == "stop":
                break
            result = receiver.refit(cycle, wait_s=60.0)
            identical, mismatched = 0, []
            for name, tensor in result.tensors:
                if name not in expected:
                    expected[name] = torch.empty_like(tensor)
                fill_pattern(expected[name], name, cycle)
                if torch.equal(expected[name].view(torch.int16), tensor.view(torch.int16)):
                    identical += 1
                else:
                    mismatched.append(name)
            s = result.stats
            results.put((
                "pulled", "receiver",
                {"tensors": s.tensors, "identical": identical, "mismatched": mismatched, "bytes": s.bytes_pulled,
                 "seconds": s.seconds, "gbps": s.gbps, "descriptors": s.descriptors,
                 "new_registrations": s.new_registrations, "transport": s.transport,
                 "handles_opened": s.handles_opened},
            ))
        receiver.close()
    except BaseException as exc:
        results.put(("error", "receiver", f"receiver: {type(exc).__name__}: {exc}"))


# How often the parent looks at its children while it waits for them.
_POLL_S = 0.5


def _expect(results: Any, kind: str, count: int, procs: list[Any]) -> list[Any]:
    """Wait for ``count`` ``kind`` messages; a child that dies is noticed within a second."""
    got: list[Any] = []
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while len(got) < count:
        try:
            what, who, payload = results.get(timeout=_POLL_S)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode is not None]
            if dead and results.empty():
                p = dead[0]
                raise RuntimeError(f"demo process {p.name} exited (code {p.exitcode}) before reporting {kind!r}; "
                                   "its stderr above says why") from None
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"timed out after {STEP_TIMEOUT_S:.0f}s waiting for {kind!r} from the demo processes"
                ) from None
            continue
        if what == "error":
            raise RuntimeError(payload)
        if what != kind:
            raise RuntimeError(f"expected {kind!r}, got {what!r} from {who}")
        got.append(payload)
    return got


def run_demo(cycles: int = 3, device: str = "cpu", trainers: int = 2, log=print, transport: str = "auto") -> dict[str, Any]:
    """Run the demo and return the summary dict printed by ``--json``."""
    from mx_refit.catalog.server import start_embedded

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    trainer_queues = [ctx.Queue() for _ in range(trainers)]
    receiver_queue = ctx.Queue()
    summary: dict[str, Any] = {"cycles": cycles, "tensors_per_cycle": 0, "identical": 0, "mismatched": 0,
                               "bytes_per_cycle": 0, "gbps": [], "transport": []}
    server = start_embedded()
    procs = [ctx.Process(target=_trainer, args=(r, trainers, server.address, device, trainer_queues[r], results,
                                                transport), name=f"mx-demo-trainer{r}") for r in range(trainers)]
    procs.append(ctx.Process(target=_receiver, args=(server.address, device, receiver_queue, results, transport),
                             name="mx-demo-receiver"))
    try:
        for p in procs:
            p.start()
        log(f"catalog at {server.address}; starting {trainers} trainers and 1 receiver on {device}")
        _expect(results, "ready", trainers + 1, procs)
        for cycle in range(1, cycles + 1):
            started = time.perf_counter()
            for q in trainer_queues:
                q.put(("publish", cycle))
            _expect(results, "published", trainers, procs)
            receiver_queue.put(("pull", cycle))
            (pulled,) = _expect(results, "pulled", 1, procs)
            summary["tensors_per_cycle"] = pulled["tensors"]
            summary["bytes_per_cycle"] = pulled["bytes"]
            summary["identical"] += pulled["identical"]
            summary["mismatched"] += len(pulled["mismatched"])
            summary["gbps"].append(round(pulled["gbps"], 3))
            summary["transport"].append(pulled["transport"])
            log(
                f"cycle {cycle}/{cycles}: {pulled['tensors']} tensors, {pulled['bytes'] / 1e6:.1f} MB in "
                f"{pulled['seconds']:.3f}s = {pulled['gbps']:.2f} GB/s over {pulled['transport']} "
                f"({pulled['descriptors']} descriptors, {pulled['handles_opened']} IPC handles opened); "
                f"{pulled['identical']} identical, {len(pulled['mismatched'])} mismatched; "
                f"new registrations {pulled['new_registrations']}; cycle wall {time.perf_counter() - started:.2f}s"
            )
            if pulled["mismatched"]:
                log(f"  mismatched: {', '.join(pulled['mismatched'][:10])}")
        for q in [*trainer_queues, receiver_queue]:
            q.put(("stop", 0))
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            if p.pid is not None:
                p.join(timeout=10)
        server.stop(0)
    return summary


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where tensors live (default cpu)")
    parser.add_argument("--cycles", type=int, default=3, help="refit cycles (default 3)")
    parser.add_argument("--transport", choices=TRANSPORT_MODES, default=AUTO,
                        help="weight_sync.transport: per-source choice (auto), or force one path")
    parser.add_argument("--json", action="store_true", help="print one JSON summary object on stdout")
    parser.add_argument(
        "--model", metavar="HF_DIR", default=None,
        help="instead of the synthetic model: load this HF checkpoint into Megatron-Core ranks through "
        "Megatron-Bridge, publish their native shards, and receive them at each --target-tp",
    )
    parser.add_argument("--source-tp", type=int, default=2, help="with --model: trainer TP size (default 2)")
    parser.add_argument("--source-ep", type=int, default=1, help="with --model: trainer EP size (default 1)")
    parser.add_argument("--target-tp", type=int, nargs="+", default=[1, 2],
                        help="with --model: receiver TP sizes, each received in turn (default 1 2)")


def megatron_demo(args: argparse.Namespace, log) -> int:
    """A real Megatron refit: Bridge-built Megatron-Core ranks -> catalog/NIXL -> receivers at
    several TP sizes, every HF tensor compared with the checkpoint's own bytes."""
    from mx_refit.verify.tool import VerifyRun, run_verify

    run = VerifyRun(
        hf_dir=args.model, source_tp=args.source_tp, source_ep=args.source_ep,
        targets=tuple((tp, 1) for tp in args.target_tp), device=args.device,
    )
    summaries = run_verify(run, log=log)
    failed = [summary["error"] for summary in summaries.values() if "error" in summary]
    if failed:
        raise RuntimeError(f"the Megatron refit failed: {failed[0]}")
    ok = True
    for (tp, _), summary in summaries.items():
        pulled, needed = summary["bytes_pulled"], summary["bytes_needed"]
        log(f"source TP={args.source_tp} -> target TP={tp}: {summary['identical']}/{summary['tensors']} HF tensors "
            f"identical, {len(summary['mismatched'])} mismatched, {len(summary['missing'])} missing; "
            f"{pulled / 1e6:.2f} MB pulled for {needed / 1e6:.2f} MB needed")
        ok = ok and not summary["mismatched"] and not summary["missing"] and summary["identical"] == summary["tensors"]
    if args.json:
        print(json.dumps({f"tp{tp}": summary for (tp, _), summary in summaries.items()}))
    return 0 if ok else 1


def preflight(args: argparse.Namespace) -> None:
    """Everything that can be checked before a process starts (raises InvalidArgument/MissingExtra)."""
    from mx_refit import preflight as checks
    from mx_refit.errors import InvalidArgument
    from mx_refit.plugins import Hooks

    checks.check_counts(cycles=args.cycles, source_tp=args.source_tp, source_ep=args.source_ep)
    if args.transport == "cuda_ipc" and args.device != "cuda":
        raise InvalidArgument(f"--transport cuda_ipc: CUDA IPC moves GPU memory; it needs --device cuda "
                              f"(got --device {args.device})")
    for tp in args.target_tp:
        checks.check_counts(target_tp=tp)
    if args.model:
        checks.require_megatron_stack()
        config = checks.read_hf_config(args.model, "--model")
        checks.check_layouts(config, source_tp=args.source_tp, source_ep=args.source_ep,
                             targets=[(tp, 1) for tp in args.target_tp])
    else:  # colocated on CUDA the demo reads over CUDA IPC and needs no NIXL
        checks.require_transport(nixl=args.device != "cuda" or args.transport == "nixl")
    checks.check_device(args.device)
    Hooks().describe()  # loads the plugins here: an unknown or broken one fails before any process starts


def demo_main(args: argparse.Namespace) -> int:
    progress = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else (lambda msg: print(msg, flush=True))
    preflight(args)
    if args.model:
        return megatron_demo(args, progress)
    summary = run_demo(cycles=args.cycles, device=args.device, log=progress, transport=args.transport)
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"{summary['cycles']} cycles x {summary['tensors_per_cycle']} tensors "
            f"({summary['bytes_per_cycle'] / 1e6:.1f} MB): {summary['identical']} identical, "
            f"{summary['mismatched']} mismatched; GB/s per cycle {summary['gbps']}; "
            f"path per cycle {summary['transport']}"
        )
    return 0 if summary["mismatched"] == 0 and summary["identical"] == summary["cycles"] * summary["tensors_per_cycle"] else 1
