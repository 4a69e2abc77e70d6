"""``mx-refit verify`` end to end: Megatron-Core ranks (through Megatron-Bridge) publish native
shards, receivers for a target layout pull them through the real catalog and NIXL, and every HF
tensor is compared with the checkpoint's safetensors bytes.

The CI subset below is chosen so each source layout is built once and received by several target
layouts (the expensive part is starting Megatron ranks). Together the cells cover: source TP
{1,2,4}, PP 2, EP 2, expert TP 1 under TP 2; target TP {1,2,4} (narrower, matched, wider), target
EP 2; GQA with fewer KV heads than source and than target ranks; MHA; qkv bias; q/k norm; MoE; tied embeddings; a
vocabulary not divisible by TP; a bf16 checkpoint (Float16Module-wrapped ranks); the CLI contract
(JSON on stdout, exit codes). The rest of the
matrix is marked ``slow`` (``pytest -m slow tests/layout/test_verify.py``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mx_refit.verify.tool import VerifyRun, run_verify
from mx_refit.verify.expect import checkpoint_index
from mx_refit.types import DTYPE_SIZES

REPO = Path(__file__).resolve().parents[2]
KEYS = {"tensors", "identical", "mismatched", "missing", "bytes_pulled", "bytes_needed", "bytes_by_role"}


def check(summary: dict, *, source_tp: int, target_tp: int, target_ep: int = 1, source_etp: int | None = None) -> None:
    assert set(summary) == KEYS, summary.get("error", summary)
    assert summary["tensors"] > 0
    assert summary["identical"] == summary["tensors"], summary
    assert summary["mismatched"] == [] and summary["missing"] == []
    assert summary["bytes_needed"] > 0
    assert summary["bytes_pulled"] == sum(p for p, _ in summary["bytes_by_role"].values())
    assert summary["bytes_needed"] == sum(n for _, n in summary["bytes_by_role"].values())
    for role, (pulled, needed) in summary["bytes_by_role"].items():
        # Bytes on the wire = bytes needed, except the column blocks of row-parallel tensors for a
        # wider target TP (experts are received whole when the target uses EP; experts are split
        # by expert TP at the source).
        etp = source_tp if source_etp is None else source_etp
        wider = (role == "row" and target_tp > source_tp) or (role == "expert_row" and target_ep == 1
                                                               and target_tp > etp)
        if wider:
            assert pulled >= needed, (role, pulled, needed)
        else:
            assert pulled == needed, (role, pulled, needed)


def verify(tiny_hf, kind: str, source: tuple[int, int, int], targets: list[tuple[int, int]],
           *, full_tensors: bool = False, receiver_procs: int | None = 1, etp: int | None = None,
           dp: int | None = None) -> dict:
    run = VerifyRun(str(tiny_hf(kind)), *source, source_etp=etp, source_dp=dp, targets=tuple(targets),
                    full_tensors=full_tensors, receiver_procs=receiver_procs, timeout_s=540)
    results = run_verify(run)
    for (tp, ep), summary in results.items():
        check(summary, source_tp=source[0], target_tp=1 if full_tensors else tp, target_ep=ep, source_etp=etp)
    return results


def test_gqa_source_tp2_to_target_tp_1_2_4(tiny_hf, bridge) -> None:
    # llama_gqa has 2 KV heads: target TP 4 replicates each KV head on 2 ranks.
    results = verify(tiny_hf, "llama_gqa", (2, 1, 1), [(1, 1), (2, 1), (4, 1)])
    assert results[(4, 1)]["bytes_needed"] > results[(1, 1)]["bytes_needed"]  # replicated KV/norms


def test_moe_source_ep2_to_target_tp_ep(tiny_hf, bridge) -> None:
    results = verify(tiny_hf, "qwen3_moe", (1, 1, 2), [(1, 1), (2, 1), (2, 2)])
    assert {"expert_column", "expert_row"} <= set(results[(2, 2)]["bytes_by_role"])
    # Target TP 2 x EP 1: the two workers split every expert (all expert bytes once in total).
    # Target TP 2 x EP 2: each worker holds its 4 experts whole, and both TP ranks of an EP rank
    # need them (all expert bytes twice in total).
    total = results[(1, 1)]["bytes_by_role"]["expert_column"][1]
    assert results[(2, 1)]["bytes_by_role"]["expert_column"][1] == total
    assert results[(2, 2)]["bytes_by_role"]["expert_column"][1] == 2 * total


def test_qwen2_tied_bias_padded_vocab_source_tp4(tiny_hf, bridge) -> None:
    # vocab 131 padded by Megatron at TP 4; 2 KV heads < source TP 4 (QKV rows cut through groups).
    verify(tiny_hf, "qwen2", (4, 1, 1), [(1, 1), (2, 1)])


def test_moe_etp1_source_tp2_ep2(tiny_hf, bridge) -> None:
    # Expert TP 1 under TP 2 x EP 2 (2 ranks): each rank publishes its dense TP shard and its
    # 4 experts whole (expert_column/expert_row unsplit); both targets get every byte.
    results = verify(tiny_hf, "qwen3_moe", (2, 1, 2), [(1, 1), (2, 1)], etp=1)
    assert {"expert_column", "expert_row"} <= set(results[(1, 1)]["bytes_by_role"])


def test_qwen3_qk_norm_source_pp2_to_target_tp4(tiny_hf, bridge) -> None:
    verify(tiny_hf, "qwen3", (1, 2, 1), [(4, 1)])


def _cli(args: list[str], timeout: float = 540) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "core" / "src"), str(REPO)]))
    return subprocess.run([sys.executable, "-m", "mx_refit.verify", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def test_cli_contract_json_exit_zero_full_tensors(tiny_hf, bridge) -> None:
    # Default: one receiver process per target rank; --full-tensors: every worker gets whole tensors.
    hf_dir = tiny_hf("llama_mha")
    proc = _cli(["--hf-dir", str(hf_dir), "--source-tp", "1", "--source-pp", "1",
                 "--source-ep", "1", "--target-tp", "2", "--full-tensors", "--json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)  # stdout holds exactly one JSON object
    check(summary, source_tp=1, target_tp=1)
    index = checkpoint_index(hf_dir)
    assert summary["tensors"] == len(index)
    checkpoint_bytes = sum(math.prod(t.shape) * DTYPE_SIZES[t.dtype] for t in index.values())
    assert summary["bytes_needed"] == 2 * checkpoint_bytes


def test_cli_detects_a_misclassified_tensor(tiny_hf, bridge, tmp_path) -> None:
    # Claim o_proj's row-parallel shards are whole tensors: the catalog accepts it (both ranks agree
    # on the claimed shape) but the received o_proj is one rank's half, which verify must catch.
    overrides = tmp_path / "overrides.json"
    overrides.write_text(json.dumps([{"role": "replicated", "pattern": "*.self_attention.linear_proj.weight"}]))
    # A bf16 checkpoint: the trainer ranks wrap the model in Float16Module ("module." prefixes).
    proc = _cli(["--hf-dir", str(tiny_hf("llama_bf16")), "--source-tp", "2", "--source-pp", "1",
                 "--source-ep", "1", "--target-tp", "1", "--role-overrides", str(overrides), "--json"])
    assert proc.returncode == 1, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["mismatched"] == [f"model.layers.{i}.self_attn.o_proj.weight" for i in range(2)]
    assert summary["identical"] == summary["tensors"] - 2 and summary["missing"] == []


# --------------------------------------------------------------------------- slow: the full matrix

SLOW_TARGETS = [(1, 1), (2, 1), (4, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("source_tp", [1, 2, 4])
@pytest.mark.parametrize("kind", ["llama_gqa", "llama_mha", "qwen2", "qwen3"])
def test_slow_dense_tp_matrix(tiny_hf, bridge, kind: str, source_tp: int) -> None:
    verify(tiny_hf, kind, (source_tp, 1, 1), SLOW_TARGETS)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama_gqa", "qwen2"])  # qwen2: tied embeddings across stages
def test_slow_pp2(tiny_hf, bridge, kind: str) -> None:
    verify(tiny_hf, kind, (2, 2, 1), SLOW_TARGETS)


@pytest.mark.slow
def test_slow_bf16_checkpoint(tiny_hf, bridge) -> None:
    verify(tiny_hf, "llama_bf16", (2, 1, 1), [(1, 1), (4, 1)])


@pytest.mark.slow
@pytest.mark.parametrize("source", [(1, 1, 1), (2, 1, 1), (1, 1, 2), (2, 1, 2)])
def test_slow_moe_matrix(tiny_hf, bridge, source: tuple[int, int, int]) -> None:
    verify(tiny_hf, "qwen3_moe", source, [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)])


@pytest.mark.slow
@pytest.mark.parametrize("source", [(4, 1, 2), (2, 2, 2)], ids=["tp4-ep2-etp1", "tp2-pp2-ep2-etp1"])
def test_slow_moe_etp1(tiny_hf, bridge, source: tuple[int, int, int]) -> None:
    # TP 4 x EP 2 x ETP 1 (4 ranks): ranks 2 and 3 publish dense shards only (the expert mesh is
    # ranks 0-1, replicated on 2-3). TP 2 x PP 2 x EP 2 x ETP 1: the same per stage.
    verify(tiny_hf, "qwen3_moe", source, [(1, 1), (2, 1)], etp=1)


@pytest.mark.slow
def test_slow_gqa_two_kv_heads_source_tp8(tiny_hf, bridge) -> None:
    # 8 query heads, 2 KV groups at TP 8: every rank holds one query head and one KV group, each
    # group replicated on 4 ranks (TP 4 is test_slow_dense_tp_matrix[llama_gqa-4]).
    verify(tiny_hf, "llama_gqa", (8, 1, 1), [(1, 1), (2, 1)])


@pytest.mark.slow
def test_slow_moe_pp2_ep2_full_tensors_one_process_per_rank(tiny_hf, bridge) -> None:
    verify(tiny_hf, "qwen3_moe", (1, 2, 2), [(2, 2), (1, 1)], full_tensors=True, receiver_procs=None)
