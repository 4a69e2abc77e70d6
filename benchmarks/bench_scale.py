"""Multi-rank Megatron refit at scale: T trainer ranks publish their native TP/EP shards in place,
vLLM-style inference workers pull exactly their TP/EP windows through the real embedded catalog
and NIXL, and every received HF tensor is checked byte for byte; NCCL baselines (broadcast from
trainer rank 0, and all-gather among trainers then broadcast) run in the same processes on the
same bytes.

    # 8 GPUs: 4 trainer ranks (TP=4) on GPUs 0-3, receivers on GPUs 4-7, ~22.7 GiB model
    python benchmarks/bench_scale.py --trainer-gpus 0,1,2,3 --receiver-gpus 4,5,6,7 \\
        --trainer-layout tp4 --out scale_h200x8.json
    # 2 GPUs: 1 trainer (TP=1) on GPU 0, receivers on GPU 1 (the two TP=2 workers share it)
    python benchmarks/bench_scale.py --trainer-gpus 0 --receiver-gpus 1 --trainer-layout tp1 \\
        --scale 0.25 --out scale_h200x2.json
    # 1 GPU, colocated (trainer and receiver share GPU 0; baseline: vLLM's ipc engine path)
    python benchmarks/bench_scale.py --trainer-gpus 0 --receiver-gpus 0 --colocated --trainer-layout tp1 \\
        --cases tp1 --scale 0.25 --out scale_colocated.json
    # CPU (DRAM, several processes), tiny
    python benchmarks/bench_scale.py --device cpu --trainer-layout tp2 --cases tp2,tp1 \\
        --scale 0.0001 --dense-layers 1 --moe-layers 2

The model (``benchmarks/_megatron_synth.py``): bf16, ``--dense-layers`` dense GQA layers then
``--moe-layers`` GQA layers with a routed MoE block of ``--experts`` experts; widths scale with
``sqrt(--scale)``. Trainer ranks keep their shards as views of one contiguous buffer (Megatron
DDP) and rewrite them in place every version (after the previous version drained).

Cases (``--cases``, comma separated, each ``[Rx]tpT[epE]``): R replicas of a vLLM worker group at
TP=T (and EP=E: E workers, worker w at tp_rank w % T, ep_rank w, experts whole), every worker
with ``full_tensors=False`` (the windows the vLLM plugin asks for since it pulls rank-exact:
``mx_refit_vllm.layout``; the plugin then copies each window into its fused parameter, a load
this benchmark does not run). Workers are placed round robin on ``--receiver-gpus``; several may
share a GPU. Default: matched (the trainers' TP, or TPxEP), replicas at TP=2 filling the receiver
GPUs, and one TP=1 receiver.

Per case and cycle: the slowest worker's whole refit (discover, plan, lease, pull, release,
materialise; workers start together at a shared deadline), the pull alone, aggregate GB/s (wire
bytes of all workers / refit time), wire vs needed bytes (receiver stats, ``plan.bytes_by_role``,
and the needed bytes recomputed independently from vLLM's sharding rules), and the byte check.
Baselines per distinct set of receiver devices: broadcast of the whole HF model (its bytes, one
flat collective) from trainer rank 0, and all-gather of the trainers' shard buffers then that
broadcast; best of ``--repeats``. NCCL on GPUs, gloo on CPU. Ratios are baseline time / mx-refit
time (> 1: mx-refit is faster).

Prints a table; ``--out`` writes the JSON, ``--json`` prints it on stdout (the table goes to
stderr then). Exits 0 only when every received tensor is byte-identical and every worker pulled
exactly its needed bytes wherever the planner promises exact reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import multiprocessing as mp
import os
import platform
import queue
import re
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # spawned children import the sibling

import _megatron_synth as synth  # noqa: E402

from mx_refit.types import MeshPosition, TargetLayout  # noqa: E402

GIB = 1 << 30
MODEL = "bench-scale"


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """``replicas`` vLLM worker groups at TP=``tp``, EP=``ep``."""

    label: str
    replicas: int
    tp: int
    ep: int

    @classmethod
    def parse(cls, text: str) -> "Case":
        match = re.fullmatch(r"(?:(\d+)x)?tp(\d+)(?:ep(\d+))?", text.strip())
        if not match:
            raise ValueError(f"--cases: expected [Rx]tpT[epE], got {text!r}")
        replicas, tp, ep = int(match.group(1) or 1), int(match.group(2)), int(match.group(3) or 1)
        if replicas < 1 or tp < 1 or ep < 1 or (ep > 1 and ep % tp):
            raise ValueError(f"--cases {text!r}: sizes must be >= 1 and EP a multiple of TP (vLLM EP = TP x DP)")
        return cls(text.strip(), replicas, tp, ep)

    @property
    def group_size(self) -> int:
        return self.ep if self.ep > 1 else self.tp

    @property
    def workers(self) -> int:
        return self.replicas * self.group_size

    def targets(self) -> list[TargetLayout]:
        """One target per worker, replica-major."""
        return [
            TargetLayout(tp_rank=w % self.tp, tp_size=self.tp, ep_rank=w if self.ep > 1 else 0,
                         ep_size=self.ep, full_tensors=False)
            for _ in range(self.replicas)
            for w in range(self.group_size)
        ]

    def exact_promised(self, layout: synth.TrainerLayout) -> bool:
        """Whether the planner promises wire bytes == needed bytes: everything is a contiguous
        read except a row-parallel column window narrower than the source's column shard."""
        dense = layout.tp % self.tp == 0
        experts = self.ep > 1 or layout.etp % self.tp == 0
        return dense and experts


def default_cases(layout: synth.TrainerLayout, receivers: int) -> list[str]:
    """Matched, TP=2 replicas filling the receiver devices, and a single TP=1 receiver."""
    if layout.ep > 1:
        matched = f"{max(1, receivers // layout.ep)}xtp{layout.tp}ep{layout.ep}"
    else:
        matched = f"tp{layout.tp}"
    mixed = f"{receivers // 2}xtp2" if receivers >= 4 else "tp2"
    out: list[str] = []
    for label in (matched, mixed, "tp1"):
        case = Case.parse(label)
        if all((c.replicas, c.tp, c.ep) != (case.replicas, case.tp, case.ep) for c in map(Case.parse, out)):
            out.append(label)
    return out


@dataclass(frozen=True)
class RunConfig:
    """Everything a child process needs (picklable)."""

    device: str  # "cuda" or "cpu"
    shape: synth.ModelShape
    layout: synth.TrainerLayout
    trainer_gpus: tuple[int, ...]
    receiver_gpus: tuple[int, ...]
    workers: int
    address: str
    dist_port: int
    timeout_s: float
    verify: bool = True
    transport: str = "auto"  # weight_sync.transport of every Publisher and Receiver
    ipc_streams: int = 0  # copy streams of a CUDA IPC read (0: the transport's default)

    @property
    def world(self) -> int:
        return self.layout.ranks + self.workers

    def trainer_device(self, rank: int) -> str:
        return f"cuda:{self.trainer_gpus[rank]}" if self.device == "cuda" else "cpu"

    def worker_gpu(self, index: int) -> int:
        return self.receiver_gpus[index % len(self.receiver_gpus)] if self.device == "cuda" else -1

    def worker_device(self, index: int) -> str:
        return f"cuda:{self.worker_gpu(index)}" if self.device == "cuda" else "cpu"

    def bcast_members(self, workers: int) -> list[int]:
        """World ranks of a broadcast to a case's workers: trainer 0 plus one worker per distinct
        device (NCCL allows one rank per GPU in a communicator; on CPU every worker counts)."""
        if self.device == "cuda":
            workers = min(workers, len(self.receiver_gpus))
        return [0, *(self.layout.ranks + i for i in range(workers))]


# --------------------------------------------------------------------------------------------
# Child processes
# --------------------------------------------------------------------------------------------


def _now() -> float:
    # CLOCK_MONOTONIC is system-wide on Linux: timestamps from different processes compare.
    return time.monotonic()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _init_dist(cfg: RunConfig, rank: int) -> None:
    """A gloo world over trainers and workers (barriers, CPU baselines); NCCL groups for the GPU
    baselines are created from it."""
    import datetime

    import torch
    import torch.distributed as dist

    if cfg.device == "cpu":
        torch.set_num_threads(1)  # several processes share the cores: no intra-op oversubscription

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg.dist_port}", rank=rank,
                            world_size=cfg.world, timeout=datetime.timedelta(seconds=cfg.timeout_s))


def _baselines(cfg: RunConfig, rank: int, plan: dict[str, Any], shard_bytes: "Any | None") -> dict[str, Any]:
    """Run every baseline of ``plan`` (all processes together); this rank's (t0, t1) per repeat.

    ``plan``: ``{"model_bytes": M, "gather_bytes": S, "repeats": n, "entries": [{"key", "members",
    "allgather"}]}``. Trainers all-gather S bytes each (their own shard buffer, zero-padded);
    trainer 0 broadcasts the first M bytes to the members.
    """
    import torch
    import torch.distributed as dist

    T, M, S = cfg.layout.ranks, plan["model_bytes"], plan["gather_bytes"]
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    dev = cfg.trainer_device(rank) if rank < T else cfg.worker_device(rank - T)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    # Every rank creates every group, in one order (a torch.distributed requirement).
    trainer_group = dist.new_group(list(range(T)), backend=backend) if T > 1 else None
    groups: dict[tuple[int, ...], Any] = {}
    for entry in plan["entries"]:
        key = tuple(entry["members"])
        if key not in groups:
            groups[key] = dist.new_group(list(key), backend=backend)
    member = any(rank in entry["members"] for entry in plan["entries"])
    send = gathered = payload = None
    if rank < T:
        send = torch.zeros(S, dtype=torch.uint8, device=dev)
        send[: shard_bytes.numel()].copy_(shard_bytes)
        gathered = torch.empty(T * S, dtype=torch.uint8, device=dev)
        if rank == 0 and T * S < M:
            raise ValueError(f"trainer buffers ({T} x {S} bytes) are smaller than the model ({M} bytes)")
        payload = gathered[:M] if rank == 0 else None
    elif member:
        payload = torch.empty(M, dtype=torch.uint8, device=dev)
    timings: dict[str, list[tuple[float, float]]] = {}
    for entry in plan["entries"]:
        members, allgather = entry["members"], entry["allgather"]
        group = groups[tuple(members)]
        takes_part = rank in members or (allgather and rank < T)
        for rep in range(plan["repeats"] + 1):  # repeat 0 warms up (NCCL communicator set-up)
            dist.barrier()
            t0 = _now()
            if allgather and rank < T and trainer_group is not None:
                all_gather(gathered, send, group=trainer_group)
            if rank in members:
                dist.broadcast(payload, src=0, group=group)
            _sync(dev)
            t1 = _now()
            if rep and takes_part:
                timings.setdefault(entry["key"], []).append((t0, t1))
    dist.barrier()
    del send, gathered, payload  # the groups live until the process ends (see _child)
    _free(dev)
    return timings


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def _child(name: str, res_q: Any, body: Callable[[], None]) -> None:
    """Run ``body``; report any failure with its traceback instead of dying silently."""
    try:
        body()
    except BaseException:
        res_q.put((name, "error", traceback.format_exc()))
        raise SystemExit(1)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()  # every group, NCCL ones included, before the interpreter exits


def trainer_main(rank: int, cfg: RunConfig, cmd_q: Any, res_q: Any) -> None:
    """One Megatron trainer rank: native shards in one buffer, rewritten and republished per version."""
    name = f"trainer{rank}"

    def body() -> None:
        import torch

        from mx_refit.publisher import Publisher

        dev = cfg.trainer_device(rank)
        if cfg.device == "cuda":
            torch.cuda.set_device(dev)
        _init_dist(cfg, rank)
        shards = synth.rank_shards(cfg.shape, cfg.layout, rank)
        buf, published = synth.rank_buffer(shards, dev)
        side = synth.sidecar(cfg.shape, cfg.layout, shards)
        tp_rank, ep_rank = cfg.layout.position(rank)
        mesh = MeshPosition(tp_rank=tp_rank, tp_size=cfg.layout.tp, ep_rank=ep_rank, ep_size=cfg.layout.ep)
        pub = Publisher(cfg.address, MODEL, mesh=mesh, expected_sources=cfg.layout.ranks, ttl_s=60.0,
                        transport_mode=cfg.transport)
        res_q.put((name, "ready", {"buffer_bytes": buf.numel() * buf.element_size(), "tensors": len(published),
                                   "pid": os.getpid(), "device": dev}))
        try:
            while True:
                cmd, arg = cmd_q.get()
                if cmd == "stop":
                    break
                if cmd == "publish":
                    version, previous = arg
                    if previous:
                        pub.wait_drained(previous, timeout_s=cfg.timeout_s)
                    started = _now()
                    for shard, tensor in zip(shards, published):  # the "optimizer step", in place
                        synth.write_shard(tensor.tensor, shard, cfg.shape, version)
                    _sync(dev)
                    written = _now()
                    state = pub.publish(version, published, sidecar=side)
                    res_q.put((name, "published", {"fill_s": written - started, "publish_s": _now() - written,
                                                   "state": state.value,
                                                   "registrations": pub.transport.registrations}))
                elif cmd == "baseline":
                    res_q.put((name, "baseline", _baselines(cfg, rank, arg, buf.view(-1).view(torch.uint8))))
        finally:
            pub.close()

    _child(name, res_q, body)


def worker_main(index: int, cfg: RunConfig, cmd_q: Any, res_q: Any) -> None:
    """One inference worker: a Receiver per case, refits on command, checks every byte."""
    name = f"worker{index}"

    def body() -> None:
        import torch

        from mx_refit.receive.receiver import Receiver

        dev = cfg.worker_device(index)
        if cfg.device == "cuda":
            torch.cuda.set_device(dev)
        _init_dist(cfg, cfg.layout.ranks + index)
        receivers: dict[str, Receiver] = {}
        res_q.put((name, "ready", {"pid": os.getpid(), "device": dev}))
        while True:
            cmd, arg = cmd_q.get()
            if cmd == "stop":
                break
            if cmd == "refit":
                label, target_fields, version, start_at = arg
                target = TargetLayout(**target_fields)
                rec = receivers.get(label)
                if rec is None:
                    rec = receivers[label] = Receiver(cfg.address, MODEL, target=target, device=dev,
                                                      reader_id=f"{label}/w{index}",
                                                      transfer_timeout_s=cfg.timeout_s,
                                                      transport_mode=cfg.transport)
                    if cfg.ipc_streams and cfg.device == "cuda":
                        rec.transport.ipc().max_streams = cfg.ipc_streams
                time.sleep(max(0.0, start_at - _now()))
                t0 = _now()
                result = rec.refit(version, wait_s=cfg.timeout_s)
                _sync(dev)
                t1 = _now()
                s, plan = result.stats, result.plan
                report = (synth.check_received(result.tensors, cfg.shape, target, version).as_dict()
                          if cfg.verify else {})
                del result
                res_q.put((name, "refit", {
                    "t0": t0, "t1": t1, "refit_s": t1 - t0, "pull_s": s.seconds, "plan_s": s.plan_seconds,
                    "bytes_pulled": s.bytes_pulled, "bytes_needed": s.bytes_needed,
                    "bytes_by_role": {k: list(v) for k, v in plan.bytes_by_role.items()},
                    "tensors": s.tensors, "descriptors": s.descriptors, "reads": len(plan.reads),
                    "sources": s.sources, "new_registrations": s.new_registrations,
                    "transport": s.transport, "handles_opened": s.handles_opened,
                    "device_copy_s": rec.transport.ipc().last_copy_s if s.transport == "cuda_ipc" else None,
                    "copy_streams": rec.transport.ipc().last_streams if s.transport == "cuda_ipc" else None,
                    "copy_kernel": rec.transport.ipc().last_kernel if s.transport == "cuda_ipc" else None,
                    "phase_s": dict(s.phase_seconds),
                    "arena_bytes": plan.arena_bytes, "check": report,
                }))
            elif cmd == "close":
                rec = receivers.pop(arg, None)
                if rec is not None:
                    rec.close()
                _free(dev)
                res_q.put((name, "closed", None))
            elif cmd == "baseline":
                res_q.put((name, "baseline", _baselines(cfg, cfg.layout.ranks + index, arg, None)))
        for rec in receivers.values():
            rec.close()

    _child(name, res_q, body)


# --------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------


class Fleet:
    """The trainer and worker processes, one command queue each and one shared result queue."""

    def __init__(self, cfg: RunConfig) -> None:
        ctx = mp.get_context("spawn")
        self.cfg = cfg
        self.results = ctx.Queue()
        self.queues: dict[str, Any] = {}
        self.procs: dict[str, Any] = {}
        for rank in range(cfg.layout.ranks):
            self._start(ctx, f"trainer{rank}", trainer_main, rank)
        for index in range(cfg.workers):
            self._start(ctx, f"worker{index}", worker_main, index)
        self.info = self.collect("ready", list(self.procs))

    def _start(self, ctx: Any, name: str, target: Callable[..., None], index: int) -> None:
        q = ctx.Queue()
        proc = ctx.Process(target=target, args=(index, self.cfg, q, self.results), name=name, daemon=True)
        proc.start()
        self.queues[name], self.procs[name] = q, proc

    @property
    def trainers(self) -> list[str]:
        return [f"trainer{r}" for r in range(self.cfg.layout.ranks)]

    def send(self, names: Sequence[str], cmd: str, arg: Any = None) -> None:
        for name in names:
            self.queues[name].put((cmd, arg))

    def collect(self, kind: str, names: Sequence[str]) -> dict[str, Any]:
        """One ``kind`` reply from each of ``names``; a child's error (or death) raises."""
        pending, got = set(names), {}
        deadline = time.monotonic() + self.cfg.timeout_s
        while pending:
            try:
                name, got_kind, payload = self.results.get(timeout=2.0)
            except queue.Empty:
                dead = [n for n, p in self.procs.items() if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"{', '.join(dead)} exited without reporting (exit codes "
                                       f"{[self.procs[n].exitcode for n in dead]})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {kind!r} from {sorted(pending)} in {self.cfg.timeout_s:.0f}s") from None
                continue
            if got_kind == "error":
                raise RuntimeError(f"{name} failed:\n{payload}")
            if got_kind != kind or name not in pending:
                raise RuntimeError(f"unexpected {got_kind!r} from {name} while waiting for {kind!r}")
            pending.discard(name)
            got[name] = payload
        return got

    def close(self) -> None:
        for name, proc in self.procs.items():
            if proc.is_alive():
                self.queues[name].put(("stop", None))
        for proc in self.procs.values():
            proc.join(60)
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()  # our own child, by its handle
                proc.join(10)


def run_case(fleet: Fleet, case: Case, first_version: int, cycles: int, previous: int) -> dict[str, Any]:
    """``cycles`` refits of ``case``; returns per-cycle numbers (raw per worker included)."""
    cfg = fleet.cfg
    targets = case.targets()
    names = [f"worker{i}" for i in range(len(targets))]
    lead = 0.3 if cfg.device == "cpu" else 0.1  # time for the command to reach every worker
    out: list[dict[str, Any]] = []
    for version in range(first_version, first_version + cycles):
        published = fleet.collect("published", _broadcast(fleet, fleet.trainers, "publish", (version, previous)))
        previous = version
        start_at = _now() + lead
        for name, target in zip(names, targets):
            fleet.queues[name].put(("refit", (case.label, asdict(target), version, start_at)))
        replies = fleet.collect("refit", names)
        workers = [replies[n] for n in names]
        t0, t1 = min(w["t0"] for w in workers), max(w["t1"] for w in workers)
        wire = sum(w["bytes_pulled"] for w in workers)
        needed = sum(w["bytes_needed"] for w in workers)
        refit_s = t1 - t0
        pull_s = max(w["pull_s"] for w in workers)
        out.append({
            "version": version, "refit_s": refit_s, "pull_s": pull_s,
            "start_skew_s": max(w["t0"] for w in workers) - t0, "wire_bytes": wire, "needed_bytes": needed,
            "aggregate_gbps": wire / refit_s / 1e9 if refit_s > 0 else 0.0,
            "aggregate_pull_gbps": wire / pull_s / 1e9 if pull_s > 0 else 0.0,
            "trainer_fill_s": max(p["fill_s"] for p in published.values()),
            "trainer_publish_s": max(p["publish_s"] for p in published.values()),
            "trainer_registrations": [published[n]["registrations"] for n in fleet.trainers],
            "workers": [{"target": asdict(t), "device": cfg.worker_device(i), **w}
                        for i, (t, w) in enumerate(zip(targets, workers))],
        })
        print(f"[{case.label}] v{version}: refit {refit_s * 1e3:.1f} ms (pull {out[-1]['pull_s'] * 1e3:.1f} ms), "
              f"{wire / GIB:.3f} GiB on the wire / {needed / GIB:.3f} GiB needed, "
              f"{out[-1]['aggregate_gbps']:.1f} GB/s aggregate, "
              f"mismatched {sum(w['check'].get('mismatched', 0) for w in workers)}", file=sys.stderr, flush=True)
    fleet.collect("closed", _broadcast(fleet, names, "close", case.label))
    return {"cycles": out, "last_version": previous}


def _broadcast(fleet: Fleet, names: Sequence[str], cmd: str, arg: Any) -> list[str]:
    fleet.send(names, cmd, arg)
    return list(names)


def run_baselines(fleet: Fleet, cases: list[Case], repeats: int) -> dict[tuple[int, ...], dict[str, float]]:
    """Broadcast and all-gather+broadcast per distinct member set; seconds, best of ``repeats``."""
    cfg = fleet.cfg
    shard_bytes = max(i["buffer_bytes"] for n, i in fleet.info.items() if n.startswith("trainer"))
    entries, seen = [], set()
    for case in cases:
        members = tuple(cfg.bcast_members(case.workers))
        if members in seen:
            continue
        seen.add(members)
        key = ",".join(map(str, members))
        entries.append({"key": f"bcast:{key}", "members": list(members), "allgather": False})
        entries.append({"key": f"ag+bcast:{key}", "members": list(members), "allgather": True})
    plan = {"model_bytes": synth.model_bytes(cfg.shape), "gather_bytes": shard_bytes, "repeats": repeats,
            "entries": entries}
    replies = fleet.collect("baseline", _broadcast(fleet, list(fleet.procs), "baseline", plan))
    out: dict[tuple[int, ...], dict[str, float]] = {}
    for entry in entries:
        spans = [r[entry["key"]] for r in replies.values() if entry["key"] in r]
        per_rep = [max(s[i][1] for s in spans) - min(s[i][0] for s in spans) for i in range(repeats)]
        kind = "allgather_bcast_s" if entry["allgather"] else "bcast_s"
        slot = out.setdefault(tuple(entry["members"]), {})
        slot[kind] = min(per_rep)
        slot[kind.replace("_s", "_median_s")] = statistics.median(per_rep)
    return out


def summarize(case: Case, layout: synth.TrainerLayout, shape: synth.ModelShape, run: dict[str, Any],
              baseline: dict[str, float] | None, receiver_devices: int,
              ipc_baseline: dict[str, float] | None = None) -> dict[str, Any]:
    """Steady-state numbers (best of cycles 2.., as bench_refit.py), checks and ratios."""
    cycles = run["cycles"]
    steady = cycles[1:] if len(cycles) > 1 else cycles
    best = min(steady, key=lambda c: c["refit_s"])
    promised = case.exact_promised(layout)
    needed_independent = [synth.window_bytes(shape, t) for t in case.targets()]
    checks = [w["check"] for c in cycles for w in c["workers"]]
    roles: dict[str, list[int]] = {}
    for w in cycles[-1]["workers"]:
        for role, (pulled, needed) in w["bytes_by_role"].items():
            acc = roles.setdefault(role, [0, 0])
            acc[0] += pulled
            acc[1] += needed
    wire_equal = all(w["bytes_pulled"] == w["bytes_needed"] for c in cycles for w in c["workers"])
    needed_agrees = all(w["bytes_needed"] == n for c in cycles for w, n in zip(c["workers"], needed_independent))
    summary: dict[str, Any] = {
        "workers": case.workers, "replicas": case.replicas, "target_tp": case.tp, "target_ep": case.ep,
        "receiver_devices": receiver_devices,
        "refit_s": best["refit_s"], "refit_median_s": statistics.median(c["refit_s"] for c in steady),
        "pull_s": min(c["pull_s"] for c in steady), "cold_refit_s": cycles[0]["refit_s"],
        "aggregate_gbps": best["aggregate_gbps"],
        "aggregate_pull_gbps": max(c["aggregate_pull_gbps"] for c in steady),
        "wire_bytes": best["wire_bytes"], "needed_bytes": best["needed_bytes"],
        "wire_over_needed": best["wire_bytes"] / best["needed_bytes"] if best["needed_bytes"] else 0.0,
        "bytes_by_role": roles,
        "exact_promised": promised, "wire_equals_needed": wire_equal,
        "needed_matches_independent": needed_agrees,
        "tensors_checked": sum(c.get("checked", 0) for c in checks),
        "identical": sum(c.get("identical", 0) for c in checks),
        "mismatched": sum(c.get("mismatched", 0) for c in checks),
        "missing": sum(c.get("missing", 0) for c in checks),
        "unexpected": sum(c.get("unexpected", 0) for c in checks),
        "descriptors_per_worker": max(w["descriptors"] for w in best["workers"]),
        "new_registrations_steady": sum(w["new_registrations"] for c in steady for w in c["workers"]),
        "handles_opened_steady": sum(w.get("handles_opened", 0) for c in steady for w in c["workers"]),
        "transport": sorted({w.get("transport", "nixl") for c in cycles for w in c["workers"]}),
    }
    copy_s = [w["device_copy_s"] for c in steady for w in c["workers"] if w.get("device_copy_s")]
    if copy_s:  # CUDA IPC: the copies alone on the device, and how many streams carried them
        summary["device_copy_s"] = min(copy_s)
        summary["copy_streams"] = max(w.get("copy_streams") or 0 for c in steady for w in c["workers"])
        summary["copy_kernel"] = all(w.get("copy_kernel") for c in steady for w in c["workers"])
    phases = [w["phase_s"] for c in steady for w in c["workers"] if w.get("phase_s")]
    if phases:  # where the whole refit goes, per step (median over steady cycles and workers)
        summary["phase_median_s"] = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
    if baseline:
        summary["baseline"] = dict(baseline)
        summary["speedup_vs_bcast"] = baseline["bcast_s"] / best["refit_s"]
        summary["speedup_vs_allgather_bcast"] = baseline["allgather_bcast_s"] / best["refit_s"]
        # The data plane alone (what the refit costs once the control plane is out of the way).
        summary["pull_speedup_vs_bcast"] = baseline["bcast_s"] / summary["pull_s"]
        summary["pull_speedup_vs_allgather_bcast"] = baseline["allgather_bcast_s"] / summary["pull_s"]
        summary["bcast_gbps_per_receiver"] = synth.model_bytes(shape) / baseline["bcast_s"] / 1e9
    if ipc_baseline:
        summary["ipc_baseline"] = dict(ipc_baseline)
        summary["refit_over_ipc"] = best["refit_s"] / ipc_baseline["ipc_open_then_copy_flat_s"]
        summary["pull_over_ipc"] = summary["pull_s"] / ipc_baseline["ipc_open_then_copy_flat_s"]
        # and against the torch device copy of the model's bytes alone (no handle to open)
        summary["refit_over_flat_copy"] = best["refit_s"] / ipc_baseline["ipc_copy_flat_s"]
        summary["refit_median_over_ipc"] = summary["refit_median_s"] / ipc_baseline["ipc_open_then_copy_flat_s"]
    summary["ok"] = (summary["mismatched"] == 0 and summary["missing"] == 0 and summary["unexpected"] == 0
                     and summary["tensors_checked"] > 0 and needed_agrees and (wire_equal or not promised))
    return summary


def table(results: dict[str, Any], device: str) -> str:
    """The human summary: one row per case (steady state, slowest worker)."""
    coll = "NCCL" if device == "cuda" else "gloo"
    head = ("case", "workers/devs", "wire GiB", "needed GiB", "wire/need", "refit ms", "pull ms", "agg GB/s",
            f"{coll} bcast ms", "AG+bcast ms", "x bcast", "x AG+bcast", "x bcast (pull)", "identical", "bad")
    rows = [head]
    for label, c in results["cases"].items():
        if "skipped" in c:
            rows.append((label, "skipped: " + c["skipped"], *[""] * (len(head) - 2)))
            continue
        b = c.get("baseline")

        def ratio(key: str) -> str:
            return f"{c[key]:.2f}x" if b else "-"

        rows.append((
            label, f"{c['workers']}/{c['receiver_devices']}", f"{c['wire_bytes'] / GIB:.3f}",
            f"{c['needed_bytes'] / GIB:.3f}", f"{c['wire_over_needed']:.4f}", f"{c['refit_s'] * 1e3:.1f}",
            f"{c['pull_s'] * 1e3:.1f}", f"{c['aggregate_gbps']:.1f}",
            f"{b['bcast_s'] * 1e3:.1f}" if b else "-", f"{b['allgather_bcast_s'] * 1e3:.1f}" if b else "-",
            ratio("speedup_vs_bcast"), ratio("speedup_vs_allgather_bcast"), ratio("pull_speedup_vs_bcast"),
            f"{c['identical']}/{c['tensors_checked']}", str(c["mismatched"] + c["missing"] + c["unexpected"]),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    model = results["config"]["model_bytes"] / GIB
    for label, c in results["cases"].items():
        if "ipc_baseline" in c:
            ipc = c["ipc_baseline"]
            lines.append(f"{label}: colocated baseline (open IPC handle {ipc['ipc_open_s'] * 1e3:.2f} ms + flat copy "
                         f"{ipc['ipc_copy_flat_s'] * 1e3:.2f} ms) = {ipc['ipc_open_then_copy_flat_s'] * 1e3:.2f} ms; "
                         f"whole refit / baseline = {c['refit_over_ipc']:.2f}, pull / baseline = {c['pull_over_ipc']:.2f}; "
                         f"path {c['transport']}, handles opened in steady cycles {c['handles_opened_steady']}, "
                         f"new registrations {c['new_registrations_steady']}; device copies alone "
                         f"{c.get('device_copy_s', 0) * 1e3:.2f} ms on {c.get('copy_streams')} stream(s), "
                         f"batched kernel {c.get('copy_kernel')}; whole refit / flat copy = "
                         f"{c['refit_over_flat_copy']:.2f}, median whole refit / baseline = "
                         f"{c['refit_median_over_ipc']:.2f}")
        if "phase_median_s" in c:
            lines.append(f"{label}: steady refit by step (median ms): " + ", ".join(
                f"{k} {v * 1e3:.3f}" for k, v in c["phase_median_s"].items()))
    lines.append(f"model {model:.3f} GiB; trainers {results['config']['trainer_layout']}; refit = slowest worker's "
                 f"discover+plan+lease+pull+release+materialise, best steady cycle; x = baseline time / mx time")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def _gpus(text: str | None) -> list[int] | None:
    if text is None:
        return None
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _machine(device: str) -> dict[str, Any]:
    import importlib.metadata

    import torch

    info: dict[str, Any] = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                            "torch": torch.__version__}
    for package in ("nixl", "grpcio"):
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    if device == "cuda":
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def _fits(cfg: RunConfig, case: Case, shape: synth.ModelShape) -> str | None:
    """Why ``case`` cannot fit its receiver GPUs' memory (None when it fits)."""
    if cfg.device != "cuda":
        return None
    import torch

    per_gpu: dict[int, int] = {}
    for i, target in enumerate(case.targets()):
        gpu = cfg.worker_gpu(i)
        per_gpu[gpu] = per_gpu.get(gpu, 0) + synth.window_bytes(shape, target)
    for gpu, need in per_gpu.items():
        total = torch.cuda.get_device_properties(gpu).total_memory
        # Arena (up to ~1.35x the needed bytes when row-parallel column blocks are staged) plus
        # ~2 GiB per worker for CUDA/NCCL/UCX contexts and the check's temporaries.
        if need * 1.35 + 2 * GIB * sum(1 for i in range(case.workers) if cfg.worker_gpu(i) == gpu) > total:
            return f"needs {need / GIB:.1f} GiB of arenas on GPU {gpu} ({total / GIB:.0f} GiB)"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--trainer-layout", default="tp4", help="tpN or tpNepM (default tp4)")
    parser.add_argument("--expert-tp", type=int, default=None, help="expert TP of the trainers (default: TP)")
    parser.add_argument("--trainer-gpus", default=None,
                        help="CUDA: e.g. 0,1,2,3 or 0-3, one per rank (default: the first GPUs)")
    parser.add_argument("--receiver-gpus", default=None,
                        help="CUDA: e.g. 4-7; workers go round robin (default: every GPU not a trainer's)")
    parser.add_argument("--receivers", type=int, default=None,
                        help="CPU only: how many receiver devices the default cases assume (default 2)")
    parser.add_argument("--cases", default=None, help="comma-separated [Rx]tpT[epE] (default: see above)")
    parser.add_argument("--scale", type=float, default=1.0, help="model bytes times this (widths x sqrt)")
    parser.add_argument("--dense-layers", type=int, default=None)
    parser.add_argument("--moe-layers", type=int, default=None)
    parser.add_argument("--experts", type=int, default=None)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="baseline repeats (best is reported)")
    parser.add_argument("--no-baselines", action="store_true")
    parser.add_argument("--colocated", action="store_true",
                        help="CUDA: trainers and receivers may share GPUs; the baseline becomes vLLM's ipc "
                             "engine path (open a CUDA IPC handle, copy the model's bytes), not NCCL")
    parser.add_argument("--ipc-streams", type=int, default=0,
                        help="copy streams of a CUDA IPC read (default: the transport's, 4; 1 = one stream)")
    parser.add_argument("--transport", choices=("auto", "nixl", "cuda_ipc"), default="auto",
                        help="weight_sync.transport of every Publisher and Receiver")
    parser.add_argument("--no-verify", action="store_true", help="skip the byte check (it is not timed)")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--out", default=None, help="write the JSON here")
    parser.add_argument("--json", action="store_true", help="print the JSON on stdout (table on stderr)")
    args = parser.parse_args(argv)

    layout = synth.TrainerLayout.parse(args.trainer_layout, args.expert_tp)
    overrides = {k: v for k, v in (("dense_layers", args.dense_layers), ("moe_layers", args.moe_layers),
                                   ("experts", args.experts)) if v is not None}
    shape = synth.ModelShape.scaled(args.scale, **overrides)
    if shape.experts % layout.ep:
        parser.error(f"--experts {shape.experts} does not divide by trainer EP {layout.ep}")

    trainer_gpus: list[int] = []
    receiver_gpus: list[int] = []
    if args.device == "cuda":
        import torch

        count = torch.cuda.device_count()
        trainer_gpus = _gpus(args.trainer_gpus) or list(range(layout.ranks))
        receiver_gpus = _gpus(args.receiver_gpus) or [g for g in range(count) if g not in trainer_gpus]
        if len(trainer_gpus) != layout.ranks:
            parser.error(f"--trainer-gpus lists {len(trainer_gpus)} GPUs, layout {layout} has {layout.ranks} ranks")
        if not receiver_gpus or (set(trainer_gpus) & set(receiver_gpus) and not args.colocated):
            parser.error("--receiver-gpus must list at least one GPU, none of them a trainer GPU")
        if max(trainer_gpus + receiver_gpus) >= count:
            parser.error(f"only {count} GPUs visible")
        n_receivers = len(set(receiver_gpus))
    else:
        n_receivers = args.receivers or 2
    cases = [Case.parse(c) for c in (args.cases.split(",") if args.cases else default_cases(layout, n_receivers))]
    shape.validate(layout.tp, layout.etp, *(c.tp for c in cases))
    for case in cases:
        if case.ep > 1 and shape.experts % case.ep:
            parser.error(f"case {case.label}: EP {case.ep} does not divide {shape.experts} experts")

    from mx_refit.catalog.server import start_embedded

    # Children inherit the environment: keep NVLink multicast (NVLS) off in NCCL unless told.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    machine = _machine(args.device)
    server = start_embedded()
    base = RunConfig(args.device, shape, layout, tuple(trainer_gpus), tuple(receiver_gpus), 0, server.address,
                     _free_port(), args.timeout_s, verify=not args.no_verify, transport=args.transport,
                     ipc_streams=args.ipc_streams)
    skipped = {c.label: why for c in cases if (why := _fits(base, c, shape))}
    runnable = [c for c in cases if c.label not in skipped]
    cfg = dataclasses.replace(base, workers=max((c.workers for c in runnable), default=0))
    results: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": machine,
        "config": {
            "device": args.device, "trainer_layout": str(layout), "tp": layout.tp, "ep": layout.ep,
            "expert_tp": layout.etp, "trainer_gpus": trainer_gpus, "receiver_gpus": receiver_gpus,
            "scale": args.scale, "shape": shape.as_dict(), "model_bytes": synth.model_bytes(shape),
            "cycles": args.cycles, "repeats": args.repeats,
            "baseline_collective": "nccl" if args.device == "cuda" else "gloo",
        },
        "cases": {},
    }
    print(f"model {synth.model_bytes(shape) / GIB:.3f} GiB ({shape.as_dict()}), trainers {layout}, "
          f"cases {[c.label for c in cases]}", file=sys.stderr, flush=True)
    fleet: Fleet | None = None
    runs: dict[str, dict[str, Any]] = {}
    baselines: dict[tuple[int, ...], dict[str, float]] = {}
    phases: dict[str, float] = {}
    started = time.monotonic()
    try:
        fleet = Fleet(cfg)
        phases["startup_s"] = time.monotonic() - started
        results["config"]["trainer_buffer_bytes"] = [fleet.info[n]["buffer_bytes"] for n in fleet.trainers]
        previous = 0
        for case in runnable:
            runs[case.label] = run_case(fleet, case, previous + 1, args.cycles, previous)
            previous = runs[case.label]["last_version"]
        phases["cases_s"] = time.monotonic() - started - phases["startup_s"]
        if not args.no_baselines and runnable and not args.colocated:
            baselines = run_baselines(fleet, runnable, args.repeats)
        phases["total_s"] = time.monotonic() - started
    finally:
        if fleet is not None:
            fleet.close()
        server.stop(0)
    ipc_baseline = None
    if args.colocated and not args.no_baselines and runnable:
        from _ipc_baseline import ipc_copy_baseline

        ipc_baseline = ipc_copy_baseline([synth.model_bytes(shape)], device=trainer_gpus[0], repeats=args.repeats)
        results["config"]["baseline_collective"] = "vLLM ipc engine path (open CUDA IPC handle + flat copy)"

    for case in cases:
        if case.label in skipped:
            results["cases"][case.label] = {"skipped": skipped[case.label]}
            continue
        baseline = baselines.get(tuple(cfg.bcast_members(case.workers)))
        summary = summarize(case, layout, shape, runs[case.label], baseline,
                            len(cfg.bcast_members(case.workers)) - 1, ipc_baseline)
        summary["cycles"] = runs[case.label]["cycles"]
        results["cases"][case.label] = summary
    results["phases"] = phases
    results["ok"] = all(c.get("ok", True) for c in results["cases"].values()) and bool(runnable)

    text = table(results, args.device)
    print(text, file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if args.json:
        print(json.dumps(results), flush=True)
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
