"""Fixtures: checkpoints, a Megatron TP2 policy (core venv), vLLM TP1 and TP2 rollouts (vLLM venv),
and a NeMo RL "job" that wires them with the reproduced synchronizer and a shipped recipe.

Processes are expensive (Megatron or vLLM import + model build), so the three groups start once
per session, concurrently; every job resets the engines (as a fresh NeMo RL job would build new
ones) but keeps the models.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
PLUGIN = HERE.parent
sys.path.insert(0, str(HERE / "nemo_rl_repro"))  # `nemo_rl.utils.checkpoint_engines.base`, reproduced

import _nemo_rl_contract as nrl  # noqa: E402
from mx_refit.testing.checkpoints import build_version  # noqa: E402
from mx_refit.testing.procs import Group, core_python, rendezvous_url, start_group, vllm_python  # noqa: E402

NOT_RUN = [
    "NeMo RL itself (not installable here: PyPI's nemo-rl is a 0.0.0 placeholder, the real one needs "
    "Python >= 3.13.14): its contract is reproduced by hand in tests/_nemo_rl_contract.py",
    "a GPU GRPO loop (Ray actors, CUDA, NCCL, vLLM 0.25.1 generation): CPU and gloo only here",
    "Megatron-Bridge 0.7.0 / megatron-core 0.20.0 (NeMo RL's pins, not on PyPI): tested with 0.6.2 / 0.19.2",
    "vLLM 0.25.1 (NeMo RL's pin): the rollout side runs vLLM 0.33's model objects",
    "real FP8 parameters (build_export_fp8_tasks) and an EAGLE drafter in vLLM: the fallback cases "
    "check the engine's decision and the bytes of NeMo RL's stream",
    "ModelOpt's quantizer folding (nvidia-modelopt, NeMo RL's quantisation worker) and Bridge 0.7's "
    "Qwen3-Next / Nemotron-H models: the quant_cfg and new-mapping-type cases check the decision "
    "(before the generator is touched, the same on every rank) and the stream path",
    "a GPU vLLM worker's arena: on CPU the default arena_device (worker) resolves to vLLM's CPU "
    "device; the cuda:N resolution is checked on torch.device values",
]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.section("not run (mx-refit-nemo-rl)")
    for line in NOT_RUN:
        terminalreporter.write_line(f"- {line}")


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {v: build_version(root, v) for v in range(6)}


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def groups(ckpts: dict[int, Path], log_dir: Path) -> Iterator[dict[str, Group]]:
    core, vllm = core_python(), vllm_python()
    if core is None or vllm is None:
        pytest.skip("needs the core venv (MX_REFIT_CORE_PYTHON) and the vLLM venv (MX_REFIT_VLLM_PYTHON)")

    def ranks(tp: int, extra: list[str]) -> list[list[str]]:
        rendezvous = rendezvous_url(log_dir)
        return [["--rank", str(r), "--world", str(tp), "--dist-init", rendezvous, *extra] for r in range(tp)]

    hf = ["--hf-dir", str(ckpts[0])]
    with ThreadPoolExecutor(3) as pool:
        futures = {
            "policy": pool.submit(start_group, "policy-tp2", core, HERE / "_policy_rank.py", ranks(2, hf), log_dir),
            "tp1": pool.submit(start_group, "vllm-tp1", vllm, HERE / "_rollout_rank.py", ranks(1, hf), log_dir),
            "tp2": pool.submit(start_group, "vllm-tp2", vllm, HERE / "_rollout_rank.py", ranks(2, hf), log_dir),
        }
        started: dict[str, Group] = {}
        failure: BaseException | None = None
        for name, future in futures.items():
            try:
                started[name] = future.result()
            except BaseException as exc:  # keep the others to stop them
                failure = failure or exc
    try:
        if failure is not None:
            raise failure
        yield started
    finally:
        for group in started.values():
            group.stop()


def compose_recipe(name: str, overrides: list[str], configs: Path) -> Any:
    """A shipped recipe loaded the way examples/run_grpo.py loads one: NeMo RL's loader, its
    parents (reduced reproductions) two folders up, Hydra overrides, ``MasterConfig``."""
    nrl.register_omegaconf_resolvers()
    config = nrl.load_config(configs / "recipes" / "llm" / name)
    config = nrl.parse_hydra_overrides(config, overrides)
    return nrl.master_config(config)


@pytest.fixture(scope="session")
def configs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """NeMo RL's examples/configs layout: reproduced parents, the plugin's recipes in recipes/llm/."""
    import shutil

    root = tmp_path_factory.mktemp("examples") / "configs"
    shutil.copytree(HERE / "nemo_rl_repro" / "configs", root)
    target = root / "recipes" / "llm"
    target.mkdir(parents=True)
    for recipe in (PLUGIN / "recipes").glob("*.yaml"):
        shutil.copy(recipe, target / recipe.name)
    return root


DENSE = "grpo-llama3.1-8b-megatron-tp2-vllm-tp1-mx.yaml"


class Job:
    """One NeMo RL job: the policy group and one vLLM engine, the engine config from a recipe,
    and the reproduced synchronizer driving them."""

    def __init__(self, policy: Group, rollout: Group, master: Any) -> None:
        self.policy, self.rollout, self.master = policy, rollout, master
        generation = master.policy["generation"]
        self.config = nrl.check_weight_synchronizer(generation)
        assert self.config is not None
        policy.call("reset_engine")
        rollout.call("reset_engine")
        self.sync = nrl.CheckpointEngineWeightSynchronizer(
            run_policy=self._run_policy,
            run_generation=self._run_generation,
            get=self._get,
            config=self.config,
            prepare_refit_info=lambda: policy.call("prepare_refit_info"),
        )

    def _run_policy(self, method: str, kwargs: dict[str, Any]) -> Any:
        return ("policy", method, self.policy.submit("rpc", (method, kwargs)))

    def _run_generation(self, method: str, args: tuple[Any, ...]) -> Any:
        # NeMo RL calls only the engine's TP/PP rank 0, whose llm.collective_rpc runs the method
        # on every vLLM worker: the group here is those workers.
        return ("generation", method, self.rollout.submit("rpc", (method, args)))

    @staticmethod
    def _get(handles: list[Any]) -> list[Any]:
        out = []
        for side, method, group in handles:
            results = group.collect(timeout_s=600)
            out.append(results if side == "policy" else nrl.collective_rpc_result(method, results))
        return out

    def train(self, hf_dir: Path) -> None:
        self.policy.call("train", str(hf_dir))

    def check(self, hf_dir: Path) -> None:
        for rank, report in enumerate(self.rollout.call("check", str(hf_dir))):
            assert report["compared"] > 0
            assert report["mismatched"] == [], f"vLLM rank {rank}: {report['mismatched']} differ from {hf_dir.name}"

    def policy_stats(self) -> list[dict[str, Any]]:
        return self.policy.call("stats")

    def rollout_stats(self) -> list[dict[str, Any]]:
        return self.rollout.call("stats")


@pytest.fixture
def job_name(request: pytest.FixtureRequest) -> str:
    return "nemo-rl-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)[:50]


@pytest.fixture
def make_job(groups: dict[str, Group], configs: Path, job_name: str):
    def make(rollout: str = "tp1", overrides: list[str] | None = None, recipe: str = DENSE) -> Job:
        base = [
            f"weight_sync.model_name={job_name}",
            "weight_sync.catalog.host=127.0.0.1",
            "weight_sync.transfer_timeout_s=240",
        ]
        master = compose_recipe(recipe, base + list(overrides or []), configs)
        return Job(groups["policy"], groups[rollout], master)

    return make
