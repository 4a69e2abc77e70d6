"""One Dynamo vLLM worker in its own process: Dynamo 1.6.1's real runtime, routes and handler.

What runs here is Dynamo's own code: a ``DistributedRuntime(loop, "mem", "tcp",
event_plane="zmq")`` whose system server listens on ``127.0.0.1:DYN_SYSTEM_PORT``, the real
``WorkerFactory.register_engine_routes`` and a real ``DecodeWorkerHandler`` (created with
``object.__new__`` plus the attributes its RL routes use, the technique of Dynamo's own tests).
The handler's engine client stands where vLLM's ``AsyncLLM`` would: ``collective_rpc`` forwards
to this worker's vLLM ranks (the vLLM plugin's ``_vllm_worker.py`` processes: vLLM's real
``Worker`` methods, the real ``mx`` engine, a real Qwen2 on CPU), and the engine-core calls the
routes make around it (pause, resume, prefix-cache reset) are recorded, since no scheduler runs.

Its own process because Dynamo's init route calls ``os._exit`` when an init times out.

Protocol: ``("describe", None)`` (the RL route registry's descriptor: routes, system_url,
world_size), ``("calls", None)`` (recorded engine-client calls since the last ask),
``("ranks", (cmd, arg))`` (forward a command to every vLLM rank), ``("stop", None)``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import traceback
from multiprocessing.connection import Client
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # no accelerator: vLLM's CPU platform
HERE = Path(__file__).resolve().parent
VLLM_TESTS = HERE.parent.parent / "vllm_engine" / "tests"

from mx_refit.testing.procs import Group, rendezvous_url, start_group  # noqa: E402
from mx_refit.testing.procs import serve as serve_commands  # noqa: E402


class ForwardingEngineClient:
    """The slice of vLLM's ``EngineClient`` that Dynamo's RL routes call."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.calls: list[tuple[str, object]] = []
        self._lock = threading.Lock()

    def _record(self, name: str, detail: object = None) -> None:
        with self._lock:
            self.calls.append((name, detail))

    def take_calls(self) -> list[tuple[str, object]]:
        with self._lock:
            calls, self.calls = self.calls, []
        return calls

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self._record("collective_rpc", method)
        return await asyncio.to_thread(self.group.call, "rpc", (method, dict(kwargs or {})), 600.0)

    async def pause_generation(self, *, mode: str = "keep", clear_cache: bool = False) -> None:
        self._record("pause_generation", mode)

    async def resume_generation(self) -> None:
        self._record("resume_generation")

    async def reset_prefix_cache(self, *args, **kwargs) -> bool:
        self._record("reset_prefix_cache")
        return True

    async def check_health(self) -> None:
        self._record("check_health")


def build_handler(runtime, engine_client, world_size: int):
    from dynamo.common.rl import RLRouteRegistry
    from dynamo.vllm import handlers
    from dynamo.vllm.handlers import DecodeWorkerHandler
    from dynamo.vllm.lora_state import LoRAState

    handler = object.__new__(DecodeWorkerHandler)
    handler.runtime = runtime
    handler.engine_client = engine_client
    handler.config = SimpleNamespace(enable_rl=True)
    handler.rl_route_registry = RLRouteRegistry(runtime, world_size=world_size)
    handler._pause_lock = asyncio.Lock()
    handler._paused = False
    handler._lora_state = LoRAState()
    handler._weight_version = handlers._WEIGHT_VERSION_UNDECLARED
    handler._deferred_aborts = {}
    return handler


async def serve(args, group: Group, conn) -> None:
    from dynamo.runtime import DistributedRuntime
    from dynamo.vllm.worker_factory import WorkerFactory

    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "mem", "tcp", event_plane="zmq")
    engine_client = ForwardingEngineClient(group)
    handler = build_handler(runtime, engine_client, len(group))
    endpoint = runtime.endpoint(f"{args.namespace}.backend.generate")
    factory = object.__new__(WorkerFactory)
    factory.register_engine_routes(runtime, endpoint, handler)
    done = asyncio.Event()

    def control() -> None:  # the test's commands, on a thread; results computed on the loop
        conn.send(("ok", {"pid": os.getpid(), "system_url": runtime.system_status_server_url()}))
        serve_commands(conn, {
            "describe": lambda _: asyncio.run_coroutine_threadsafe(
                handler.rl_route_registry.dispatch({"method": "routes"}), loop
            ).result(60),
            "calls": lambda _: engine_client.take_calls(),
            "ranks": lambda arg: group.call(arg[0], arg[1], 600.0),
        })
        loop.call_soon_threadsafe(done.set)

    threading.Thread(target=control, daemon=True).start()
    await done.wait()
    runtime.shutdown()


def _import_dynamo() -> None:
    import dynamo.runtime  # noqa: F401
    import dynamo.vllm.handlers  # noqa: F401
    import dynamo.vllm.worker_factory  # noqa: F401


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--worker-script", default="_vllm_worker.py")
    parser.add_argument("--worker-args", default="")
    args = parser.parse_args()
    host, port = args.listen.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["MX_TEST_AUTHKEY"]))
    # Dynamo's modules import (tens of seconds) while the vLLM ranks start, not after.
    preload = threading.Thread(target=_import_dynamo, daemon=True)
    preload.start()
    try:
        rendezvous = rendezvous_url(args.log_dir)
        extra = args.worker_args.split() if args.worker_args else []
        per_rank = [
            ["--rank", str(r), "--world", str(args.tp), "--dist-init", rendezvous, "--hf-dir", args.hf_dir, *extra]
            for r in range(args.tp)
        ]
        script = args.worker_script if (HERE / args.worker_script).exists() else str(VLLM_TESTS / args.worker_script)
        # A start-up budget for vLLM ranks on a loaded 2-core machine.
        group = start_group(f"{args.namespace}-vllm", sys.executable, HERE / script, per_rank, Path(args.log_dir),
                            start_timeout_s=1200.0)
    except BaseException:
        conn.send(("err", ("StartupError", traceback.format_exc())))
        return
    preload.join()
    try:
        asyncio.run(serve(args, group, conn))
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        group.stop()


if __name__ == "__main__":
    main()
