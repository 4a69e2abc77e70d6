"""Processes for the failover, reader-death and soak tests, driven by JSON lines like ``_workers.py``.

``python _failover_workers.py source --catalog A --model M --rank R --ranks N``: a long-lived
    trainer rank; ``publish`` (stamp the buffers with the version, then publish; ``cover`` also
    publishes a copy of the other rank's own tensor), ``drain`` (wait_drained, timed), ``exit``.
``python _failover_workers.py reader --catalog A --model M``: a long-lived inference worker with
    an engine (a dict of tensors, loaded through the built-in loader) that SIGKILLs a source at a
    chosen point of its pull (``refit`` with ``kill``), and reports which version every engine
    tensor holds afterwards.
``python _failover_workers.py soak-trainer|soak-reader ...``: the soak's two processes; ``run``
    loops the cycles inside the process (no per-cycle round trip through the test).
Zygote children (``{"cmd": "spawn", "fn": "_failover_workers:victim" | ":doomed_reader"}``):
    a rank that publishes one version and lives until killed; a reader that SIGKILLs itself at
    a chosen point of a refit.

Every tensor is a version stamp: every byte depends on the version (and on the tensor), so a
tensor matches exactly one version, and bytes of two versions never pass for either.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _workers import commands, emit  # noqa: E402

SHARED = 3  # replicated tensors every rank publishes (identical bytes on every rank)
_MASK = (1 << 64) - 1


def _wrap(value: int) -> int:
    value &= _MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def stamp(version: int, salt: int, n: int):
    """int64 elements mixing (version, salt, index): each of the 8 bytes depends on all three."""
    import torch

    x = torch.arange(n, dtype=torch.int64) * 0x9E3779B97F4A7C1 + _wrap(version * 0x2545F4914F6CDD1D + salt * 0x94D049BB133111E)
    x ^= x >> 29
    x *= 0x3C79AC492BA7B65
    x ^= x >> 32
    return x


def salt_of(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("shared.") else 100 + int(name[1:].split(".")[0])


def names(rank: int, ranks: int, cover: bool) -> list[str]:
    own = [f"r{rank}.own"] + ([f"r{(rank + 1) % ranks}.own"] if cover and ranks > 1 else [])
    return [f"shared.{k}" for k in range(SHARED)] + own


def matching_version(tensor, name: str, candidates) -> int | None:
    """The one candidate version whose stamp ``tensor`` is, else None (torn or foreign bytes)."""
    import torch

    flat = tensor.reshape(-1).view(torch.int64)
    for v in candidates:
        if v is not None and torch.equal(flat, stamp(v, salt_of(name), flat.numel())):
            return v
    return None


def wait_gone(pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    return
        except (OSError, IndexError):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} still alive {timeout:.0f} s after SIGKILL")
        time.sleep(0.002)


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    wait_gone(pid)


class Rank:
    """One trainer rank's buffers: every tensor it may publish, stamped in place per version."""

    def __init__(self, catalog: str, model: str, rank: int, ranks: int, elems: int, ttl: float,
                 expected_readers: int = 0) -> None:
        import torch

        from mx_refit.publisher import Publisher
        from mx_refit.types import MeshPosition

        self.rank, self.ranks, self.elems = rank, ranks, elems
        self.buffers = {n: torch.empty(elems, dtype=torch.int64) for n in names(rank, ranks, cover=True)}
        self.pub = Publisher(catalog, model, mesh=MeshPosition(tp_rank=rank, tp_size=ranks),
                             expected_sources=ranks, ttl_s=ttl, expected_readers=expected_readers)

    def publish(self, version: int, cover: bool = False):
        from mx_refit.types import PublishedTensor

        chosen = names(self.rank, self.ranks, cover)
        for name in chosen:  # the optimizer step: new bytes in the same buffers
            self.buffers[name].copy_(stamp(version, salt_of(name), self.elems))
        return self.pub.publish(version, [PublishedTensor(n, self.buffers[n]) for n in chosen])


def run_source(args: argparse.Namespace) -> None:
    rank = Rank(args.catalog, args.model, args.rank, args.ranks, args.elems, args.ttl)
    emit({"event": "ready", "pid": os.getpid(), "source_id": rank.pub.source_id})
    for cmd in commands():
        try:
            if cmd["cmd"] == "publish":
                emit({"state": rank.publish(cmd["version"], cmd.get("cover", False)).value})
            elif cmd["cmd"] == "drain":
                began = time.monotonic()
                rank.pub.wait_drained(cmd["version"], timeout_s=cmd.get("timeout", 60))
                emit({"drained": True, "seconds": time.monotonic() - began, "at": time.time()})
            elif cmd["cmd"] == "exit":
                rank.pub.close()
                emit({"bye": True})
                return
        except Exception as exc:
            emit({"error": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc()})


def victim(catalog: str, cmd: dict) -> None:
    """Zygote child: one rank publishing one version, alive (heart-beating) until killed."""
    rank = Rank(catalog, cmd["model"], cmd["rank"], cmd["ranks"], cmd["elems"], cmd.get("ttl", 30.0))
    state = rank.publish(cmd["version"], cmd.get("cover", False))
    emit({"event": "published", "tag": cmd.get("tag"), "pid": os.getpid(), "state": state.value,
          "source_id": rank.pub.source_id})
    threading.Event().wait()


def _killing_transport(name: str):
    """A NIXL transport that SIGKILLs ``self.kill = (pid, source_id, point)`` at that point of
    its next read: ``before-read`` (lease held, nothing posted), ``before-post`` (other sources'
    requests in flight, the victim's not yet posted), ``posted`` (the victim's request in
    flight), ``timer`` (a random 0-3 ms into the read); ``frozen`` SIGSTOPs it instead (lease
    held, nothing posted): its heartbeats stop and its reads time out."""
    from mx_refit.transport.nixl import NixlTransport

    class KillingTransport(NixlTransport):
        kill: tuple[int, str, str] | None = None

        def read_many(self, *a, **kw):  # type: ignore[no-untyped-def]
            timer = None
            if self.kill is not None and self.kill[2] in ("before-read", "frozen"):
                self._strike()
            elif self.kill is not None and self.kill[2] == "timer":
                timer = threading.Timer(random.uniform(0, 0.003), self._strike)
                timer.start()
            try:
                return super().read_many(*a, **kw)
            finally:
                if timer is not None:  # the death has happened by the time the read reports
                    timer.join()

        def _post(self, job, timeout):  # type: ignore[no-untyped-def]
            ours = self.kill is not None and job.peer_key == self.kill[1]
            if ours and self.kill[2] == "before-post":
                self._strike()
            super()._post(job, timeout)
            if ours and self.kill is not None and self.kill[2] == "posted":
                self._strike()

        def _strike(self) -> None:
            armed, self.kill = self.kill, None
            if armed is not None and armed[2] == "frozen":  # alive, but neither beating nor serving
                os.kill(armed[0], signal.SIGSTOP)
            elif armed is not None:
                kill(armed[0])

    return KillingTransport(name)


def run_reader(args: argparse.Namespace) -> None:
    from mx_refit import hookimpl
    from mx_refit.plugins import Hooks
    from mx_refit.receive.receiver import Receiver

    failures: list[str] = []

    class CountFailures:
        @hookimpl
        def mx_refit_refit_failed(self, model, version, error):  # type: ignore[no-untyped-def]
            failures.append(type(error).__name__)

    hooks = Hooks()
    hooks.register(CountFailures(), "count-failures")
    transport = _killing_transport(f"failover-reader-{os.getpid()}")
    engine: dict = {}
    rec = Receiver(args.catalog, args.model, engine=engine, hooks=hooks, transport=transport,
                   lease_ttl_s=args.lease_ttl, transfer_timeout_s=args.transfer_timeout,
                   fanout=args.fanout, max_readers_per_source=args.max_readers)
    emit({"event": "ready", "pid": os.getpid(), "reader_id": rec.reader_id})
    for cmd in commands():
        try:
            if cmd["cmd"] == "refit":
                kill_at = cmd.get("kill")
                transport.kill = (kill_at["pid"], kill_at["source_id"], kill_at["point"]) if kill_at else None
                reply: dict = {}
                kept = rec.lease_ttl_s, rec.transfer_timeout_s  # a case may run with its own
                rec.lease_ttl_s = cmd.get("lease_ttl", rec.lease_ttl_s)
                rec.transfer_timeout_s = cmd.get("transfer_timeout", rec.transfer_timeout_s)
                began = time.monotonic()
                try:
                    result = rec.refit(cmd["version"])
                    version = result.version.version
                    wrong = [n for n, t in result.tensors if matching_version(t, n, [version]) is None]
                    reply = {"ok": True, "version": version, "wrong": wrong, "tensors": len(result.tensors),
                             "failed_over": list(result.stats.failed_over),
                             "bytes_reread": result.stats.bytes_reread, "replicas_read": result.stats.replicas_read}
                except Exception as exc:
                    reply = {"ok": False, "error": type(exc).__name__, "message": str(exc),
                             "failed_sources": list(getattr(exc, "failed_sources", ())),
                             "missing": [list(m) for m in getattr(exc, "missing", ())]}
                finally:
                    struck = transport.kill is None and kill_at is not None
                    transport.kill = None
                    rec.lease_ttl_s, rec.transfer_timeout_s = kept
                reply["struck"] = struck
                reply["seconds"] = time.monotonic() - began
                reply["failures_seen"] = len(failures)
                # which version every engine tensor holds: one of the candidates, or None (mixed)
                candidates = cmd.get("candidates", [])
                reply["engine"] = {n: matching_version(t, n, candidates) for n, t in sorted(engine.items())}
                emit(reply)
            elif cmd["cmd"] == "exit":
                rec.close()
                transport.close()
                emit({"bye": True})
                return
        except Exception as exc:
            emit({"ok": False, "error": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc()})


def replica(catalog: str, cmd: dict) -> None:
    """Zygote child: a receiver with tree fan-out that pulls ``cmd["version"]`` and then offers
    its arena as a replica source of it, alive (heart-beating) until killed."""
    from mx_refit.receive.receiver import Receiver

    rec = Receiver(catalog, cmd["model"], fanout="tree", lease_ttl_s=10.0)
    rec.refit(cmd["version"])
    assert rec.replica is not None and rec.replica.version == cmd["version"], "the replica was not offered"
    emit({"event": "published", "tag": cmd.get("tag"), "pid": os.getpid(), "source_id": rec.replica.source_id})
    threading.Event().wait()


def doomed_reader(catalog: str, cmd: dict) -> None:
    """Zygote child: a reader that SIGKILLs itself at ``cmd["point"]`` of a refit of
    ``cmd["version"]``: ``before-lease`` (discovered, no lease), ``leased`` (lease held, nothing
    read), ``mid-pull`` (its READ posted and in flight), ``pulled`` (every byte in, not released).
    Its NIXL agent is made only when a read needs it (the first two points never read)."""
    from mx_refit.receive.receiver import Receiver
    from mx_refit.transport.nixl import NixlTransport
    from mx_refit.transport.routing import RoutingTransport

    point, me = cmd["point"], os.getpid()
    armed = False

    def die(where: str) -> None:
        if armed and where == point:
            emit({"event": "dying", "tag": cmd.get("tag"), "pid": me, "point": point, "at": time.time()})
            os.kill(me, signal.SIGKILL)

    class DoomedAgent(NixlTransport):
        def _post(self, job, timeout):  # type: ignore[no-untyped-def]
            super()._post(job, timeout)
            die("mid-pull")

    class Doomed(RoutingTransport):
        def nixl(self, *, required: bool = True):  # type: ignore[no-untyped-def]
            if self._nixl is None:
                self._nixl = DoomedAgent(self.agent_name)
            return super().nixl(required=required)

        def read(self, *a, **kw):  # type: ignore[no-untyped-def]
            die("leased")
            report = super().read(*a, **kw)
            die("pulled")
            return report

    class Catalog:
        """The receiver's catalog calls, with a death before the lease is acquired."""

        def __init__(self, inner) -> None:  # type: ignore[no-untyped-def]
            self._inner = inner

        def acquire_lease(self, *a, **kw):  # type: ignore[no-untyped-def]
            die("before-lease")
            return self._inner.acquire_lease(*a, **kw)

        def lease_version(self, *a, **kw):  # type: ignore[no-untyped-def]  # find and lease in one call
            die("before-lease")
            return self._inner.lease_version(*a, **kw)

        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            return getattr(self._inner, name)

    # The warm-up's lease outlasts the rank's 60 s lease fence, so its release is waited for:
    # none of it may still be queued on the renewal thread when this process dies.
    rec = Receiver(catalog, cmd["model"], transport=Doomed("nixl", name=f"doomed-{me}"), lease_ttl_s=120.0)
    rec.client = Catalog(rec.client)  # type: ignore[assignment]
    if point in ("mid-pull", "pulled"):
        # A first refit connects to the source and registers the arena (slow once: on a loaded
        # box slower than a short lease); the second, under the short lease, is the one that dies.
        rec.refit(cmd["version"])
    rec.lease_ttl_s, armed = cmd["lease_ttl"], True
    rec.refit(cmd["version"])
    emit({"event": "survived", "tag": cmd.get("tag"), "pid": me})  # the point was never reached


def run_soak_trainer(args: argparse.Namespace) -> None:
    """Publish, wait until the reader completed its read, drain, and mutate at once: N times."""
    rank = Rank(args.catalog, args.model, 0, 1, args.elems, args.ttl, expected_readers=1)
    emit({"event": "ready", "pid": os.getpid()})
    for cmd in commands():
        if cmd["cmd"] != "run":
            break
        began = time.monotonic()
        try:
            for version in range(cmd["first"], cmd["first"] + cmd["cycles"]):
                assert rank.publish(version).value == "READY"
                rank.pub.wait_read(version, timeout_s=60)  # retires and drains once read
                # the next publish stamps the buffers with version + 1 right away (mutation)
            emit({"done": True, "seconds": time.monotonic() - began})
        except Exception as exc:
            emit({"done": False, "error": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc()})


def run_soak_reader(args: argparse.Namespace) -> None:
    """Refit every version in turn and check every tensor against every version stamp."""
    from mx_refit.errors import FailedPrecondition, NotFound
    from mx_refit.receive.receiver import Receiver

    rec = Receiver(args.catalog, args.model, lease_ttl_s=args.lease_ttl, transfer_timeout_s=args.transfer_timeout)
    emit({"event": "ready", "pid": os.getpid()})
    for cmd in commands():
        if cmd["cmd"] != "run":
            break
        began = time.monotonic()
        torn, checked, refits = [], 0, 0
        try:
            for version in range(cmd["first"], cmd["first"] + cmd["cycles"]):
                deadline = time.monotonic() + 60
                while True:  # the trainer is between its drain and the next publish: ask again soon
                    try:
                        result = rec.refit(min_version=version)
                        break
                    except (NotFound, FailedPrecondition):
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.001)
                refits += 1
                got = result.version.version
                assert got == version, f"asked for version {version}, refitted {got}"
                for name, tensor in result.tensors:
                    checked += 1
                    match = matching_version(tensor, name, [got, got - 1, got + 1])
                    if match != got:
                        torn.append({"version": got, "tensor": name, "matches": match})
            emit({"done": True, "refits": refits, "tensors_checked": checked, "torn": torn[:20],
                  "torn_count": len(torn), "seconds": time.monotonic() - began})
        except Exception as exc:
            emit({"done": False, "error": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc()})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["source", "reader", "soak-trainer", "soak-reader"])
    parser.add_argument("--catalog", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--elems", type=int, default=1 << 12)
    parser.add_argument("--ttl", type=float, default=30.0)
    parser.add_argument("--lease-ttl", type=float, default=10.0)
    parser.add_argument("--transfer-timeout", type=float, default=10.0)
    parser.add_argument("--fanout", default="none")
    parser.add_argument("--max-readers", type=int, default=0)
    args = parser.parse_args()
    {"source": run_source, "reader": run_reader, "soak-trainer": run_soak_trainer,
     "soak-reader": run_soak_reader}[args.role](args)


if __name__ == "__main__":
    main()
