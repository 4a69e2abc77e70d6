"""The pause a staged refit costs a decode loop: stage the next version while the loop keeps
stepping, commit between two steps, and report the longest gap between steps.

A Qwen3-8B-shaped stand-in for the engine (``--layers`` x [fused QKV, o_proj, fused gate/up,
down_proj], bf16, no attention kernel: the matmuls of one decode step at batch ``--batch``) runs in
the main thread. A Publisher in the same process publishes a new version of every weight; a
Receiver with the loop's weights as its engine (``mx_refit_load_weights`` copies into them)
``stage()``s it on a thread while the loop keeps stepping, then the loop calls ``commit()``
between two steps. Reported (one JSON object): the loop's median step before the refit, the
longest gap between two step ends while the stage ran and through the commit, the commit alone,
and the whole stage; ``target_ok`` is the issue's bound (gap <= 2 x step + commit). After the
commit every weight is checked against the published bytes. Two refits are measured: the first
(plans made, IPC handles opened) and a steady one (the next version of the same layout, what every
RL step after the first costs).

The loop waits for each step as an engine does, on its own stream (vLLM records an event after
the sampled tokens' copy and waits on it), never with a device-wide synchronize, which would also
wait for the stage's copies on their own stream.

    # one H200 (the lead's command; Qwen3-8B-shaped: 36 layers, hidden 4096, FFN 12288)
    python benchmarks/bench_decode_pause.py --device cuda:0 --out decode_pause_h200.json
    # CPU smoke run (tiny)
    python benchmarks/bench_decode_pause.py --device cpu --layers 2 --hidden 256 --ffn 512 --heads 4 --kv-heads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core" / "src"))


def build_weights(args: argparse.Namespace, seed: int) -> dict[str, "torch.Tensor"]:  # noqa: F821
    import torch

    # Drawn on the device: 36 Qwen3-8B-shaped layers drawn on the host took over a minute.
    g = torch.Generator(device=args.device).manual_seed(seed)
    head_dim = args.hidden // args.heads
    qkv_rows = (args.heads + 2 * args.kv_heads) * head_dim
    shapes = {"qkv": (qkv_rows, args.hidden), "o": (args.hidden, args.hidden),
              "gate_up": (2 * args.ffn, args.hidden), "down": (args.hidden, args.ffn)}
    out = {}
    for layer in range(args.layers):
        for name, shape in shapes.items():
            t = (torch.rand(shape, generator=g, device=args.device) - 0.5).mul_(0.02)
            out[f"layers.{layer}.{name}"] = t.to(torch.bfloat16)
    return out


def step(weights: dict, x: "torch.Tensor", args: argparse.Namespace) -> "torch.Tensor":  # noqa: F821
    import torch

    for layer in range(args.layers):
        w = weights
        h = x @ w[f"layers.{layer}.qkv"].T
        y = h[:, : args.hidden] @ w[f"layers.{layer}.o"].T
        g = y @ w[f"layers.{layer}.gate_up"].T
        x = (torch.nn.functional.silu(g[:, : args.ffn]) * g[:, args.ffn :]) @ w[f"layers.{layer}.down"].T
        x = torch.nn.functional.normalize(x, dim=-1)
    return x


def sync(device: str) -> None:
    """Wait for this thread's stream only, as an engine waits for its sampled tokens."""
    import torch

    if device.startswith("cuda"):
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()


def run(args: argparse.Namespace) -> dict[str, object]:
    import torch

    from mx_refit import Publisher, Receiver, start_catalog

    engine = build_weights(args, seed=1)
    new = build_weights(args, seed=2)
    x0 = torch.randn(args.batch, args.hidden, dtype=torch.bfloat16, device=args.device)
    ends: list[float] = []

    def one() -> None:
        step(engine, x0, args)
        sync(args.device)
        ends.append(time.perf_counter())

    for _ in range(args.warmup):
        one()
    ends.clear()
    for _ in range(args.steps):
        one()
    normal = statistics.median(b - a for a, b in zip(ends, ends[1:]))

    def refit(publisher, receiver, version: int) -> dict[str, object]:  # noqa: ANN001
        staged: dict[str, object] = {}

        def stage() -> None:
            began = time.perf_counter()
            try:
                receiver.stage(version)
            finally:
                staged["seconds"] = time.perf_counter() - began

        thread = threading.Thread(target=stage, name="stage")
        ends.clear()
        one()
        thread.start()
        while thread.is_alive():
            one()  # serving the old version while the new one arrives
        thread.join()
        began = time.perf_counter()
        committed = receiver.commit()
        sync(args.device)
        commit_s = time.perf_counter() - began
        for _ in range(args.after):
            one()
        gaps = [b - a for a, b in zip(ends, ends[1:])]
        wrong = [n for n, t in new.items() if not torch.equal(engine[n], t)]
        return {
            "version": version,
            "steps_during_stage": len(gaps) - args.after,
            "max_gap_ms": max(gaps) * 1e3,
            "commit_ms": commit_s * 1e3,
            "stage_s": staged["seconds"],
            "refit_phase_seconds": committed.stats.phase_seconds,
            "target_ok": max(gaps) <= 2 * normal + commit_s,
            "weights_equal_published": not wrong,
        }

    catalog = start_catalog()
    result: dict[str, object] = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
        "layers": args.layers, "hidden": args.hidden, "ffn": args.ffn, "batch": args.batch,
        "parameter_bytes": sum(t.numel() * t.element_size() for t in engine.values()),
        "normal_step_ms": normal * 1e3,
    }
    try:
        with Publisher(catalog.address, "decode", expected_sources=1) as publisher, \
                Receiver(catalog.address, "decode", engine=engine, device=args.device) as receiver:
            publisher.publish(1, model=new)
            result["first"] = refit(publisher, receiver, 1)
            publisher.wait_drained(1)
            for t in new.values():  # the optimizer's step, in place: the same layout, new bytes
                t.mul_(-1)
            publisher.publish(2, model=new)
            result["steady"] = refit(publisher, receiver, 2)
    finally:
        catalog.stop()
    cycles = [result["first"], result["steady"]]
    result["target_ok"] = all(c["target_ok"] for c in cycles)  # type: ignore[index]
    result["weights_equal_published"] = all(c["weights_equal_published"] for c in cycles)  # type: ignore[index]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=12288)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--after", type=int, default=5, help="steps after the commit")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = run(args)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    sys.exit(0 if result.get("weights_equal_published") else 1)


if __name__ == "__main__":
    main()
