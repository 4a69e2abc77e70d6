"""Processes for the fan-out tests and benchmark, driven over a Pipe: a TP-sharded Megatron
trainer (the planner harness's native shards, published in place from real NIXL-registered
buffers) and receivers (real ``Receiver`` s, one NIXL agent each)."""

from __future__ import annotations

import os
import time
import traceback
from typing import Any


def _spec():
    from tests.layout._planner_harness import ModelSpec

    return ModelSpec("fanout", layers=2)


def published(seed: int, tp: int, layers: int = 2, hidden: int = 32):
    from dataclasses import replace

    from tests.layout._planner_harness import SourceLayout, publish

    return publish(replace(_spec(), layers=layers, hidden=hidden), SourceLayout(tp=tp), seed=seed, gaps=False)


def expected(seed: int, tp: int, target: Any, layers: int = 2, hidden: int = 32):
    """HF name -> the bytes a receiver of ``target`` must end up with."""
    from dataclasses import replace

    from tests.layout._planner_harness import expected_window

    spec = replace(_spec(), layers=layers, hidden=hidden)
    pub = published(seed, tp, layers, hidden)
    return {n: w for n, full in pub.hf.items() if (w := expected_window(n, full, spec, target)) is not None}


def trainer(conn, address: str, model: str, tp: int, layers: int = 2, hidden: int = 32) -> None:
    """All ``tp`` ranks of one trainer in one process (a Publisher and NIXL agent per rank)."""
    import torch

    from mx_refit.publisher import Publisher
    from mx_refit.types import PublishedTensor

    try:
        first = published(0, tp, layers, hidden)
        buffers = {sid: mem.clone() for sid, (_, mem) in first.memory.items()}
        pubs, tensors = {}, {}
        for source in first.version.sources:
            sid = source.source_id
            base = first.memory[sid][0]
            buf = buffers[sid]
            tensors[sid] = [
                PublishedTensor(
                    d.name,
                    buf[d.addr - base : d.addr - base + d.nbytes].view(getattr(torch, d.dtype)).view(d.local_shape),
                    d.role, d.global_shape, d.shard_axis, d.shard_offset, dict(d.extras),
                )
                for d in source.tensors
            ]
            pubs[sid] = Publisher(address, model, mesh=source.mesh, expected_sources=tp, ttl_s=30.0,
                                  source_id=f"{model}-{sid}")
        conn.send(("ready", os.getpid()))
        while True:
            cmd, arg = conn.recv()
            if cmd == "stop":
                break
            if cmd == "publish":
                version, seed = arg
                fresh = published(seed, tp, layers, hidden)
                for sid, buf in buffers.items():  # the trainer mutates its buffers in place
                    buf.copy_(fresh.memory[sid][1])
                states = [pubs[sid].publish(version, tensors[sid], sidecar=fresh.version.sidecar).value
                          for sid in sorted(pubs)]
                conn.send(("published", states))
            elif cmd == "drain":
                version, timeout = arg
                began = time.perf_counter()
                try:
                    for pub in pubs.values():
                        pub.wait_drained(version, timeout_s=timeout)
                    conn.send(("drained", time.perf_counter() - began))
                except TimeoutError as exc:
                    conn.send(("drained", str(exc)))
        for pub in pubs.values():
            pub.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def receiver(conn, address: str, model: str, kwargs: dict[str, Any], target: Any = None) -> None:
    """One inference worker: ``refit`` commands answer (version, replicas read, seconds,
    tensors); ``wall`` answers the refit's wall-clock start and end (for the benchmark)."""
    from mx_refit.receive.receiver import Receiver

    try:
        rec = Receiver(address, model, target=target, **kwargs)
        conn.send(("ready", os.getpid()))
        while True:
            cmd, arg = conn.recv()
            if cmd == "stop":
                break
            if cmd == "refit":
                version, send_tensors = arg
                began = time.time()
                result = rec.refit(version, wait_s=60)
                ended = time.time()
                tensors = {n: t.clone() for n, t in result.tensors} if send_tensors else None
                conn.send(("refitted", (result.version.version, result.stats.replicas_read, began, ended,
                                        result.stats.seconds, tensors)))
        rec.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


class Procs:
    """Spawned processes with a command pipe each (closed with :meth:`close`)."""

    def __init__(self) -> None:
        import multiprocessing as mp

        self._ctx = mp.get_context("spawn")
        self.conns: list[Any] = []
        self.procs: list[Any] = []

    def start(self, target, *args) -> int:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=target, args=(child, *args), daemon=True)
        proc.start()
        self.conns.append(parent)
        self.procs.append(proc)
        return len(self.conns) - 1

    def expect(self, i: int, kind: str, timeout: float = 120):
        conn = self.conns[i]
        if not conn.poll(timeout):
            raise TimeoutError(f"no {kind!r} from process {i}")
        got, payload = conn.recv()
        if got == "error":
            raise RuntimeError(payload)
        assert got == kind, (got, payload)
        return payload

    def send(self, i: int, cmd: str, arg: Any = None) -> None:
        self.conns[i].send((cmd, arg))

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send(("stop", None))
                except OSError:
                    pass
            proc.join(15)
            if proc.is_alive():
                proc.kill()
