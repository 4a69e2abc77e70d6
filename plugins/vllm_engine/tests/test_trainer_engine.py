"""A plain PyTorch/DTensor trainer (2 processes) -> vLLM's RL HTTP routes -> a vLLM worker.

Everything on the path is real: vLLM's ``ModuleSource`` over DTensor parameters,
``WeightTransferTrainerFactory`` dispatching ``MxTrainerInitInfo`` to our engine, vLLM's
``HTTPVLLMWeightSyncClient`` posting JSON, vLLM's ``Worker`` methods calling the ``mx`` engine,
the catalog over gRPC and NIXL reads from the trainer processes into the worker's arena.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _relay import Relay

from mx_refit.testing.procs import rendezvous_url, start_group, vllm_python


@pytest.fixture
def trainers(request, mx_catalog: str, model_name: str, relay: Relay, tp1, ckpts: dict[int, Path], log_dir: Path):
    relay.group = tp1.group
    rendezvous = rendezvous_url(log_dir)
    args = [
        [
            "--rank",
            str(r),
            "--world",
            "2",
            "--dist-init",
            rendezvous,
            "--catalog",
            mx_catalog,
            "--model-name",
            model_name,
            "--relay",
            relay.url,
            "--hf-dir",
            str(ckpts[0]),
            *(["--load"] if getattr(request, "param", "staged") == "load" else []),
        ]
        for r in range(2)
    ]
    group = start_group("torch-trainer", vllm_python(), Path(__file__).parent / "_torch_trainer.py", args, log_dir)
    yield group
    group.stop()
    relay.group = None


def test_dtensor_trainer_drives_vllm_worker_over_http(
    trainers, tp1, relay: Relay, ckpts: dict[int, Path]
) -> None:
    # trainer_init (rank 0) already initialised the worker's engine through the HTTP route.
    assert [m for m, _ in relay.calls[-1:]] == ["init_weight_transfer_engine"]
    init_info = relay.calls[-1][1]["init_info"]
    assert init_info["load_batch_bytes"] == 64 << 10 and init_info["model"].startswith("vllm-")

    first = trainers.call("send", (1, str(ckpts[1])))
    tp1.check(ckpts[1])
    tp1.current = ckpts[1]
    with pytest.raises(AssertionError, match="differ from qwen2-v0"):
        tp1.check(ckpts[0])  # the byte comparison does tell versions apart
    # Staged (the default): the pull starts unpaused; generation is paused for the commit only.
    calls = relay.calls[-6:]
    assert [m for m, _ in calls] == [
        "start_weight_update", "update_weights", "pause", "update_weights", "finish_weight_update", "resume",
    ]
    assert calls[1][1]["update_info"]["version"] == 1 and calls[1][1]["update_info"]["phase"] == "stage"
    assert calls[2][1] == {"mode": "wait", "clear_cache": "false"}
    assert calls[3][1]["update_info"]["phase"] == "commit"
    registrations = tp1.stats()[0]["registrations"]
    arenas = tp1.stats()[0]["arenas"]

    # Step 2: the trainer mutates its shards in place; nothing is re-registered on either side.
    second = trainers.call("send", (2, str(ckpts[2])))
    tp1.check(ckpts[2])
    tp1.current = ckpts[2]
    for before, after in zip(first, second, strict=True):
        assert after["pointers"] == before["pointers"]
        assert after["registrations"] == before["registrations"]
    stats = tp1.stats()[0]
    assert stats["registrations"] == registrations, "the receive arena was registered again"
    assert stats["arenas"] == arenas, "the receive arena was reallocated"
    assert not stats["active"] and not stats["session"]


@pytest.mark.parametrize("trainers", ["load"], indirect=True)
def test_direct_trainer_path_pauses_generation_around_the_load(
    trainers, tp1, relay: Relay, ckpts: dict[int, Path]
) -> None:
    """``MxTrainerInitInfo(staged=False)``: one ``phase="load"`` with generation paused around
    the whole update session."""
    trainers.call("send", (3, str(ckpts[3])))
    tp1.check(ckpts[3])
    tp1.current = ckpts[3]
    calls = relay.calls[-5:]
    assert [m for m, _ in calls] == ["pause", "start_weight_update", "update_weights", "finish_weight_update",
                                     "resume"]
    assert calls[2][1]["update_info"]["phase"] == "load" and calls[2][1]["update_info"]["version"] == 3


def test_a_client_that_cannot_pause_is_refused() -> None:
    """vLLM's Ray client has no pause route: the trainer refuses it at once, naming ``pause=False``;
    a client with ``pause_generation``/``resume_generation`` is paused through them."""
    from vllm.distributed.weight_transfer import RayVLLMWeightSyncClient

    from mx_refit.errors import InvalidArgument
    from mx_refit_vllm.trainer import pause_controls

    with pytest.raises(InvalidArgument, match="RayVLLMWeightSyncClient cannot pause generation.*pause=False"):
        pause_controls(RayVLLMWeightSyncClient([]), "wait")
    seen: list[tuple[str, str | None]] = []

    class Pausable:
        def pause_generation(self, mode: str) -> None:
            seen.append(("pause", mode))

        def resume_generation(self) -> None:
            seen.append(("resume", None))

    pause, resume = pause_controls(Pausable(), "keep")
    pause()
    resume()
    assert seen == [("pause", "keep"), ("resume", None)]


def test_direct_workers_load_in_one_paused_step() -> None:
    """Workers with ``receive_mode: direct`` have no staging arena: the trainer engine drives one
    ``phase="load"`` inside its pause instead of stage + commit; bad worker settings are refused
    at construction, naming the field."""
    from mx_refit.errors import InvalidArgument
    from mx_refit_vllm.trainer import MxTrainerInitInfo

    info = MxTrainerInitInfo(catalog="h:1", model="m", rank=0,
                             worker={"receive_mode": "direct", "receive_buffer_bytes": 1 << 20})
    assert info.staged is False and info.pause is True
    assert info.worker_init_info().receive_buffer_bytes == 1 << 20
    assert MxTrainerInitInfo(catalog="h:1", model="m", rank=0).staged is True
    with pytest.raises(InvalidArgument, match=r"MxInitInfo.receive_buffer_bytes: must be an integer >= 4096, got 10"):
        MxTrainerInitInfo(catalog="h:1", model="m", rank=0, worker={"receive_mode": "direct", "receive_buffer_bytes": 10})
