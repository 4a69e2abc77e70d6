"""``mx-refit verify``: prove a Megatron layout round-trips an HF checkpoint byte for byte.

::

    mx-refit verify --hf-dir DIR --source-tp T --source-pp P --source-ep E [--source-etp X]
                    [--source-dp D] --target-tp T2 [--target-ep E2] [--device cpu|cuda]
                    [--full-tensors] --json

1. ``T*P*D`` trainer processes (one per Megatron rank; gloo on CPU, NCCL on GPU) load the
   checkpoint into a Megatron-Core model through Megatron-Bridge; the publishing ranks
   (``mx_refit.is_publishing_rank``: the first data-parallel replica of each dense position and
   the first expert-data-parallel replica of each expert position) publish their NATIVE shards
   in place with the core ``Publisher`` (classifier + sidecar from ``mx_refit.megatron``).
   Expert TP ``X`` defaults to ``T``; ``D`` defaults to the smallest data-parallel size the
   expert mesh fits in (``lcm(T, X*E) / T``: ``E`` when ``X == T``);
2. receivers for the target layout (one process per target rank, ``T2*E2``) refit through the
   real catalog (``start_embedded``) and NIXL with the core ``Receiver``;
3. every HF tensor a receiver materialises is compared with the checkpoint's own safetensors
   bytes: the whole tensor with ``--full-tensors``, otherwise the receiver's vLLM-style window
   (computed here, independently of the planner).

Prints one JSON object (a stable contract)::

    {"tensors", "identical", "mismatched", "missing", "bytes_pulled", "bytes_needed", "bytes_by_role"}

and exits 0 only when every checkpoint tensor was received identical by every receiver that
needs it, 1 when some were not, 2 for a usage error (bad flag, or a layout that ``config.json``
rules out: checked before any process starts), 3 for a missing optional dependency, and 4 when
the run itself failed (the object then also carries ``"error"``, and stderr says why).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mx_refit.types import TargetLayout
from mx_refit.verify.expect import checkpoint_dtype, checkpoint_index, compare_received, expected_windows

__all__ = ["VerifyRun", "add_verify_arguments", "default_dp", "run_verify", "verify_from_args", "verify_main"]

VERSION = 1


@dataclass(frozen=True)
class VerifyRun:
    """One verification: a source layout and one or more target layouts (each verified alone)."""

    hf_dir: str
    source_tp: int = 1
    source_pp: int = 1
    source_ep: int = 1
    source_etp: int | None = None  # None: expert TP = TP (Megatron's default)
    source_dp: int | None = None  # None: the smallest that fits the expert mesh (default_dp)
    targets: tuple[tuple[int, int], ...] = ((1, 1),)  # (target TP, target EP)
    device: str = "cpu"
    full_tensors: bool = False
    receiver_procs: int | None = None  # None: one process per target rank
    timeout_s: float = 600.0
    role_overrides: tuple[dict[str, Any], ...] = ()  # config overrides, on top of the plugins'

    @property
    def etp(self) -> int:
        return self.source_tp if self.source_etp is None else self.source_etp

    @property
    def dp(self) -> int:
        return default_dp(self.source_tp, self.source_ep, self.etp) if self.source_dp is None else self.source_dp

    @property
    def world(self) -> int:
        return self.source_tp * self.source_pp * self.dp

    @property
    def publishers(self) -> int:
        """How many of the ranks publish (the core rule, ``mx_refit.expected_sources``)."""
        from mx_refit.megatron.parallel import expected_sources

        return expected_sources(self.source_tp, self.source_pp, self.source_ep, self.etp)


def default_dp(tp: int, ep: int, etp: int) -> int:
    """The smallest data-parallel size whose ``tp * dp`` ranks per stage hold the expert mesh
    (``etp * ep`` must divide them): ``ep`` when ``etp == tp``, as verify always ran."""
    return math.lcm(tp, etp * ep) // tp


# ----------------------------------------------------------------------------- processes


def _stdout_to_stderr() -> None:
    """Child processes keep stdout clean for the JSON object (Megatron prints progress there)."""
    sys.stdout.flush()
    os.dup2(2, 1)


def _source_rank(rank: int, run: VerifyRun, init_method: str, address: str, model: str, commands: Any,
                 results: Any) -> None:
    """One Megatron trainer rank: build from HF, publish native shards, wait for ``stop``."""
    import logging
    import warnings

    from mx_refit._logsetup import configure_child
    from mx_refit.plugins import TRACE_ENV

    _stdout_to_stderr()
    warnings.filterwarnings("ignore")
    level = configure_child()
    if level in (None, "WARNING") and os.environ.get(TRACE_ENV, "").strip() in ("", "0"):
        logging.disable(logging.WARNING)  # Megatron/Bridge chatter would bury the progress lines
    try:
        import torch

        from mx_refit.megatron.collect import collect_for_publish
        from mx_refit.megatron.parallel import ParallelContext
        from mx_refit.plugins import Hooks
        from mx_refit.publisher import Publisher
        from mx_refit.verify.harness import (
            build_model_from_hf,
            destroy_distributed,
            init_distributed,
            init_model_parallel,
        )

        init_distributed(rank, run.world, init_method=init_method, device=run.device, timeout_s=run.timeout_s)
        init_model_parallel(run.source_tp, run.source_pp, run.source_ep, run.etp)
        dtype = getattr(torch, checkpoint_dtype(run.hf_dir))
        built = build_model_from_hf(run.hf_dir, tp=run.source_tp, pp=run.source_pp, ep=run.source_ep,
                                    etp=run.etp, device=run.device, dtype=dtype)
        hooks = Hooks()
        hooks.configure({"role_overrides": list(run.role_overrides)})
        overrides = hooks.role_overrides()
        tensors, sidecar = collect_for_publish(built.bridge, built.model, overrides)  # every rank: a PP collective
        ctx = ParallelContext.from_parallel_state()
        publisher = None
        if ctx.publishes:
            publisher = Publisher(address, model, mesh=ctx.mesh(), expected_sources=run.publishers,
                                  ttl_s=max(30.0, run.timeout_s))
            publisher.publish(VERSION, tensors, sidecar=sidecar)
        results.put(("published", rank, {"tensors": len(tensors),  # none on a rank that does not publish
                                          "bytes": sum(t.tensor.numel() * t.tensor.element_size() for t in tensors)}))
        commands.get(timeout=run.timeout_s)  # keep the shards alive until the receivers are done
        if publisher is not None:
            publisher.close()
        destroy_distributed()
    except BaseException as exc:  # never leave the parent waiting
        results.put(("error", f"source rank {rank}", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _receiver_proc(targets: list[TargetLayout], run: VerifyRun, address: str, model: str, results: Any) -> None:
    """Refit each assigned target rank (its own Receiver and NIXL agent) and compare bytes."""
    from mx_refit._logsetup import configure_child

    _stdout_to_stderr()
    configure_child()
    try:
        from mx_refit.receive.receiver import Receiver

        for target in targets:
            device = "cpu"
            if run.device == "cuda":
                import torch

                device = f"cuda:{(target.ep_rank * target.tp_size + target.tp_rank) % torch.cuda.device_count()}"
            with Receiver(address, model, target=target, device=device,
                          reader_id=f"verify-tp{target.tp_rank}-ep{target.ep_rank}") as receiver:
                result = receiver.refit(VERSION, wait_s=run.timeout_s)
                expected = expected_windows(result.version, target, checkpoint_index(run.hf_dir))
                report: dict[str, Any] = compare_received(run.hf_dir, expected, result.tensors)
                report.update(
                    bytes_pulled=result.stats.bytes_pulled,
                    bytes_needed=result.stats.bytes_needed,
                    bytes_by_role={k: list(v) for k, v in result.plan.bytes_by_role.items()},
                )
            results.put(("received", (target.tp_size, target.ep_size), report))
    except BaseException as exc:
        results.put(("error", "receiver", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _target_ranks(tp: int, ep: int, full: bool) -> list[TargetLayout]:
    return [TargetLayout(tp_rank=t, tp_size=tp, ep_rank=e, ep_size=ep, full_tensors=full)
            for e in range(ep) for t in range(tp)]


# ----------------------------------------------------------------------------- aggregation


def _summarise(names: Sequence[str], reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Fold the receivers' reports of one target layout into the public JSON object."""
    needed_by: dict[str, int] = {}
    bad: set[str] = set()
    missing: set[str] = set()
    good: dict[str, int] = {}
    by_role: dict[str, list[int]] = {}
    pulled = needed = 0
    for report in reports:
        for name in report["expected"]:
            needed_by[name] = needed_by.get(name, 0) + 1
        for name in report["identical"]:
            good[name] = good.get(name, 0) + 1
        bad.update(report["mismatched"])
        missing.update(report["missing"])
        pulled += report["bytes_pulled"]
        needed += report["bytes_needed"]
        for role, (p, n) in report["bytes_by_role"].items():
            acc = by_role.setdefault(role, [0, 0])
            acc[0] += p
            acc[1] += n
    missing.update(n for n in names if n not in needed_by)  # no receiver would ever get it
    identical = [n for n in names if n not in bad and n not in missing and good.get(n, 0) == needed_by.get(n, -1)]
    return {
        "tensors": len(names),
        "identical": len(identical),
        "mismatched": sorted(bad),
        "missing": sorted(missing - bad),
        "bytes_pulled": pulled,
        "bytes_needed": needed,
        "bytes_by_role": {role: by_role[role] for role in sorted(by_role)},
    }


def _failure(names: Sequence[str], error: str) -> dict[str, Any]:
    return {"tensors": len(names), "identical": 0, "mismatched": [], "missing": sorted(names),
            "bytes_pulled": 0, "bytes_needed": 0, "bytes_by_role": {}, "error": error}


# ----------------------------------------------------------------------------- driver


class _Phase:
    """Waits for messages from the verify processes, failing fast on errors, deaths and timeouts."""

    def __init__(self, results: Any, deadline: float, timeout_s: float) -> None:
        self.results = results
        self.deadline = deadline
        self.timeout_s = timeout_s

    def collect(self, kind: str, count: int, procs: Sequence[Any]) -> list[tuple[Any, Any]]:
        got: list[tuple[Any, Any]] = []
        while len(got) < count:
            try:
                what, who, payload = self.results.get(timeout=max(0.1, min(2.0, self.deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > self.deadline:
                    raise TimeoutError(f"verify timed out after {self.timeout_s:.0f}s waiting for {kind!r} "
                                       f"({len(got)}/{count})") from None
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and self.results.empty():
                    raise RuntimeError(f"{dead[0].name} died (exit code {dead[0].exitcode}) without reporting") from None
                continue
            if what == "error":
                raise RuntimeError(f"{who} failed: {payload}")
            if what != kind:
                raise RuntimeError(f"expected {kind!r} from the verify processes, got {what!r} from {who}")
            got.append((who, payload))
        return got


def run_verify(run: VerifyRun, log: Callable[[str], None] | None = None) -> dict[tuple[int, int], dict[str, Any]]:
    """Run one verification; returns ``{(target_tp, target_ep): summary}`` (the JSON objects).

    Sources are built and published once; the target layouts are then received one after the
    other (each receiver process is started only when its layout's turn comes: an idle NIXL agent
    still costs CPU, and CI machines are small).
    """
    import shutil
    import tempfile

    from mx_refit.catalog.server import start_embedded
    from mx_refit.verify.harness import rendezvous_url

    log = log or (lambda msg: None)
    names = sorted(checkpoint_index(run.hf_dir))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    model = f"verify-{os.getpid()}-{int(time.time() * 1000) % 100000}"
    server = start_embedded()
    phase = _Phase(results, time.monotonic() + run.timeout_s, run.timeout_s)
    commands = [ctx.Queue() for _ in range(run.world)]
    rendezvous = tempfile.mkdtemp(prefix="mx-refit-verify-")
    init_method = rendezvous_url(rendezvous)
    sources = [ctx.Process(target=_source_rank, args=(r, run, init_method, server.address, model, commands[r], results),
                           name=f"mx-verify-source{r}", daemon=True) for r in range(run.world)]
    procs: list[Any] = list(sources)
    summaries: dict[tuple[int, int], dict[str, Any]] = {}
    started = time.perf_counter()
    log(f"verify {run.hf_dir}: source tp={run.source_tp} pp={run.source_pp} ep={run.source_ep} etp={run.etp} "
        f"dp={run.dp} ({run.world} ranks, {run.publishers} publishing) -> targets {list(run.targets)}; "
        f"catalog {server.address}")
    try:
        for proc in sources:
            proc.start()
        phase.collect("published", run.world, procs)
        log(f"  published by {run.world} ranks in {time.perf_counter() - started:.1f}s")
        for tp, ep in run.targets:
            ranks = _target_ranks(tp, ep, run.full_tensors)
            count = min(run.receiver_procs or len(ranks), len(ranks))
            receivers = [ctx.Process(target=_receiver_proc, args=(ranks[i::count], run, server.address, model, results),
                                     name=f"mx-verify-receiver-tp{tp}-ep{ep}-{i}", daemon=True) for i in range(count)]
            procs += receivers
            begun = time.perf_counter()
            for proc in receivers:
                proc.start()
            reports = [payload for _, payload in phase.collect("received", len(ranks), procs)]
            for proc in receivers:
                proc.join(timeout=30.0)
            summaries[(tp, ep)] = summary = _summarise(names, reports)
            log(f"  target tp={tp} ep={ep}: {summary['identical']}/{summary['tensors']} identical, "
                f"{summary['bytes_pulled']} bytes pulled / {summary['bytes_needed']} needed "
                f"({len(ranks)} ranks in {count} processes, {time.perf_counter() - begun:.1f}s)")
    except (RuntimeError, TimeoutError) as exc:
        summaries = {t: summaries.get(t) or _failure(names, str(exc)) for t in run.targets}
    finally:
        for q in commands:
            q.put("stop")
        for proc in procs:
            if proc.pid is not None:
                proc.join(timeout=30.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        server.stop(0)
        shutil.rmtree(rendezvous, ignore_errors=True)
    return summaries


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    """The verify command line (a public contract: only ever add optional flags)."""
    parser.add_argument("--hf-dir", required=True, help="HF checkpoint directory (config.json + safetensors)")
    parser.add_argument("--source-tp", type=int, default=1, help="trainer tensor parallel size")
    parser.add_argument("--source-pp", type=int, default=1, help="trainer pipeline parallel size")
    parser.add_argument("--source-ep", type=int, default=1, help="trainer expert parallel size")
    parser.add_argument("--source-etp", type=int, default=None,
                        help="trainer expert tensor parallel size (default: --source-tp)")
    parser.add_argument("--source-dp", type=int, default=None,
                        help="trainer data parallel size; world = tp x pp x dp (default: the smallest that holds "
                             "the expert mesh, lcm(tp, etp x ep) / tp)")
    parser.add_argument("--target-tp", type=int, default=1, help="receiver tensor parallel size")
    parser.add_argument("--target-ep", type=int, default=1, help="receiver expert parallel size")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where shards and arenas live")
    parser.add_argument("--full-tensors", action="store_true",
                        help="receivers ask for whole HF tensors instead of their TP/EP windows")
    parser.add_argument("--receiver-procs", type=int, default=None,
                        help="receiver processes (default: one per target rank)")
    parser.add_argument("--role-overrides", default=None, metavar="JSON",
                        help="file with a JSON list of role overrides ({role, pattern|module_class, shard_axis?})")
    parser.add_argument("--timeout", type=float, default=600.0, help="overall timeout in seconds")
    parser.add_argument("--json", action="store_true", help="print only the JSON object on stdout")


def verify_main(argv: list[str]) -> int:
    """Entry point of ``mx-refit verify``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="mx-refit verify", description=__doc__.split("\n\n")[0])
    add_verify_arguments(parser)
    return verify_from_args(parser.parse_args(argv), parser)


def verify_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """Run verify from arguments parsed with :func:`add_verify_arguments` (for a host CLI that
    adds them to its own sub-command parser); returns the exit code."""

    def fail(message: str) -> int:
        if parser is not None:
            parser.error(message)  # exits 2
        print(f"mx-refit: error: verify: {message}", file=sys.stderr)
        return 2

    from mx_refit import preflight
    from mx_refit.errors import InvalidArgument

    try:  # everything config.json can tell, before any process starts
        preflight.check_counts(source_tp=args.source_tp, source_pp=args.source_pp, source_ep=args.source_ep,
                               source_etp=args.source_etp, source_dp=args.source_dp,
                               target_tp=args.target_tp, target_ep=args.target_ep,
                               receiver_procs=args.receiver_procs)
        config = preflight.read_hf_config(args.hf_dir)
        preflight.check_layouts(config, source_tp=args.source_tp, source_pp=args.source_pp,
                                source_ep=args.source_ep, source_etp=args.source_etp, source_dp=args.source_dp,
                                targets=[(args.target_tp, args.target_ep)])
    except InvalidArgument as exc:
        return fail(str(exc))
    preflight.require_megatron_stack()  # MissingExtra names the extra to install
    preflight.check_device(args.device)
    overrides: tuple[dict[str, Any], ...] = ()
    if args.role_overrides:
        from mx_refit.errors import ClassificationError
        from mx_refit.overrides import RoleOverrides

        try:
            with open(args.role_overrides) as handle:
                loaded = json.load(handle)
            if not isinstance(loaded, list) or not all(isinstance(e, dict) for e in loaded):
                raise ValueError("expected a JSON list of objects")
            RoleOverrides.from_config(loaded)  # validate here, before any process starts
        except (OSError, ValueError, ClassificationError) as exc:
            return fail(f"--role-overrides {args.role_overrides!r}: {exc}")
        overrides = tuple(loaded)
    run = VerifyRun(
        hf_dir=os.path.abspath(args.hf_dir), source_tp=args.source_tp, source_pp=args.source_pp,
        source_ep=args.source_ep, source_etp=args.source_etp, source_dp=args.source_dp,
        targets=((args.target_tp, args.target_ep),), device=args.device,
        full_tensors=args.full_tensors, receiver_procs=args.receiver_procs, timeout_s=args.timeout,
        role_overrides=overrides,
    )
    summary = run_verify(run, log=lambda msg: print(msg, file=sys.stderr, flush=True))[(args.target_tp, args.target_ep)]
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=2), flush=True)
    if "error" in summary:
        cause = summary["error"].partition("\nTraceback")[0].strip().replace("\n", " | ")
        print(f"mx-refit: error: verify failed: {cause}", file=sys.stderr, flush=True)
        return 4
    ok = summary["identical"] == summary["tensors"] and not summary["mismatched"] and not summary["missing"]
    return 0 if ok else 1

if __name__ == "__main__":  # pragma: no cover - `python -m mx_refit.verify ...`
    sys.exit(verify_main(sys.argv[1:]))
