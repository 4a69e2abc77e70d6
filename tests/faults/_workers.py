"""Publisher and reader processes for fault-injection tests, driven by JSON lines on stdin.

``python _workers.py publisher --catalog ADDR --model M [--rank R --ranks N --ttl S --lease-fence S]``
``python _workers.py reader --catalog ADDR --model M [--lease-ttl S] [--gate]``
``python _workers.py zygote --catalog ADDR --model M`` (forks publisher processes on command;
``{"cmd": "spawn", "fn": "module:function", ...}`` forks one running that function instead)

Every reply is one JSON line on stdout. The tensors are int64 with a pattern that encodes
(version, rank, tensor, element), so a reader can tell bytes of the leased version from bytes
of another version or a torn mix. ``--gate`` makes the reader stop right before its NIXL READ
(lease held) and print ``{"event": "gate"}`` until it reads ``{"cmd": "go"}``: the test then
injects a fault (SIGSTOP, a cut link, a catalog restart) at a known point of the pull.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

ELEMS = 1 << 15  # per tensor: 256 KiB
TENSORS = 2


def pattern(version: int, rank: int, k: int, n: int = ELEMS):
    import torch

    return torch.arange(n, dtype=torch.int64) + ((version << 40) + (rank << 32) + (k << 24))


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def commands():
    for line in sys.stdin:
        if line.strip():
            yield json.loads(line)


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def run_publisher(args: argparse.Namespace) -> None:
    from mx_refit.publisher import Publisher
    from mx_refit.types import MeshPosition, PublishedTensor

    tensors = [pattern(0, args.rank, k) for k in range(TENSORS)]
    pub = Publisher(
        args.catalog, args.model, mesh=MeshPosition(tp_rank=args.rank, tp_size=args.ranks),
        expected_sources=args.ranks, ttl_s=args.ttl, lease_fence_s=args.lease_fence,
    )
    published = [PublishedTensor(f"r{args.rank}.t{k}", t) for k, t in enumerate(tensors)]
    emit({"event": "ready", "pid": os.getpid(), "source_id": pub.source_id})
    for cmd in commands():
        try:
            if cmd["cmd"] == "publish":
                for k, t in enumerate(tensors):
                    t.copy_(pattern(cmd["version"], args.rank, k))
                state = pub.publish(cmd["version"], published)
                emit({"state": state.value})
            elif cmd["cmd"] == "drain":  # then mutate at once, like the optimizer step
                pub.wait_drained(cmd["version"], timeout_s=cmd.get("timeout", 30))
                for k, t in enumerate(tensors):
                    t.copy_(pattern(cmd["then"], args.rank, k))
                emit({"drained": True})
            elif cmd["cmd"] == "fds":
                emit({"fds": fd_count()})
            elif cmd["cmd"] == "exit":
                pub.close()
                emit({"bye": True})
                return
        except Exception as exc:
            emit({"error": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc()})


def run_zygote(args: argparse.Namespace) -> None:
    """Forks short-lived publisher processes on command, with torch and NIXL already imported
    (a cold start costs seconds on a loaded 2-core box). Each child is a real new process: its
    own pid, incarnation and NIXL agent. It publishes one version, prints ``published`` and then
    lives (heart-beating) until the test kills it."""
    import signal

    import torch  # noqa: F401  (mx_refit imports it lazily: a child would pay seconds for it)

    import mx_refit.publisher  # noqa: F401  (warm imports: grpc, the catalog client)
    import mx_refit.receive.receiver  # noqa: F401
    from mx_refit.plugins import Hooks
    from mx_refit.transport.nixl_agent import load_nixl

    load_nixl()
    Hooks().describe()  # plugin modules imported once, here
    # The first agent of a process pays ~0.5 s of one-time NIXL/UCX set-up (backend plugins,
    # config); made and closed here, a child's own agent then starts in ~0.05 s.
    from mx_refit.transport.nixl import NixlTransport

    NixlTransport(f"zygote-warm-{os.getpid()}").close()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped automatically
    emit({"event": "ready", "pid": os.getpid()})
    for cmd in commands():
        if cmd["cmd"] == "exit":
            return
        if cmd["cmd"] != "spawn":
            continue
        pid = os.fork()
        if pid:
            continue
        try:  # the child
            sys.stdin.close()
            if cmd.get("fn"):  # "module:function" beside this file, called as fn(catalog, cmd)
                import importlib

                module, _, name = cmd["fn"].partition(":")
                getattr(importlib.import_module(module), name)(args.catalog, cmd)
            else:
                child_publish(args.catalog, cmd)
        except BaseException as exc:
            emit({"event": "child-error", "tag": cmd.get("tag"), "error": type(exc).__name__, "message": str(exc)})
        finally:
            os._exit(0)


def child_publish(catalog: str, cmd: dict) -> None:
    import threading

    from mx_refit.publisher import Publisher
    from mx_refit.types import MeshPosition, PublishedTensor

    rank, ranks, version = cmd.get("rank", 0), cmd.get("ranks", 1), cmd["version"]
    tensors = [pattern(version, rank, k) for k in range(TENSORS)]
    pub = Publisher(catalog, cmd["model"], mesh=MeshPosition(tp_rank=rank, tp_size=ranks),
                    expected_sources=ranks, ttl_s=cmd.get("ttl", 30.0))
    state = pub.publish(version, [PublishedTensor(f"r{rank}.t{k}", t) for k, t in enumerate(tensors)])
    emit({"event": "published", "tag": cmd.get("tag"), "pid": os.getpid(), "state": state.value,
          "incarnation": getattr(pub, "incarnation", None), "source_id": pub.source_id})
    threading.Event().wait()  # until killed


def run_reader(args: argparse.Namespace) -> None:
    from mx_refit.receive.receiver import Receiver
    from mx_refit.transport.nixl import NixlTransport

    class GatedTransport(NixlTransport):
        gate = args.gate

        def read_many(self, *a, **kw):  # type: ignore[no-untyped-def]
            if self.gate:
                emit({"event": "gate"})
                go = json.loads(sys.stdin.readline())
                assert go["cmd"] == "go", go
            return super().read_many(*a, **kw)

    transport = GatedTransport(f"fault-reader-{os.getpid()}")
    rec = Receiver(args.catalog, args.model, transport=transport, lease_ttl_s=args.lease_ttl,
                   transfer_timeout_s=args.transfer_timeout)
    emit({"event": "ready", "pid": os.getpid()})
    for cmd in commands():
        try:
            if cmd["cmd"] == "refit":
                result = rec.refit(cmd.get("version"), min_version=cmd.get("min_version", 0),
                                   wait_s=cmd.get("wait_s", 0.0))
                version = result.version.version
                wrong = []
                for name, tensor in result.tensors:
                    rank, k = (int(part[1:]) for part in name.split("."))
                    if not bool((tensor == pattern(version, rank, k)).all()):
                        wrong.append(name)
                emit({"ok": True, "version": version, "wrong": wrong, "tensors": len(result.tensors)})
            elif cmd["cmd"] == "gate":
                transport.gate = cmd["on"]
                emit({"gate": transport.gate})
            elif cmd["cmd"] == "fds":
                emit({"fds": fd_count(), "peers": len(transport._remote.peers), "loaded": len(transport._remote.loaded)})
            elif cmd["cmd"] == "exit":
                rec.close()
                transport.close()
                emit({"bye": True})
                return
        except Exception as exc:
            emit({"ok": False, "error": type(exc).__name__, "message": str(exc),
                  "cause": getattr(exc, "cause", None)})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["publisher", "reader", "zygote"])
    parser.add_argument("--catalog", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--ttl", type=float, default=5.0)
    parser.add_argument("--lease-fence", type=float, default=2.0)
    parser.add_argument("--lease-ttl", type=float, default=1.0)
    parser.add_argument("--transfer-timeout", type=float, default=10.0)
    parser.add_argument("--gate", action="store_true")
    args = parser.parse_args()
    {"publisher": run_publisher, "reader": run_reader, "zygote": run_zygote}[args.role](args)


if __name__ == "__main__":
    main()
