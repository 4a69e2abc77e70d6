"""One vLLM rank of a real Qwen3-MoE model on CPU: the rank's windows of a checkpoint placed by
:class:`mx_refit_vllm.params.ParamMap` must equal vLLM's own ``load_weights`` of it.

``python _moe_worker.py RANK WORLD EP DIST_INIT CKPT_LIVE CKPT_NEXT``: builds the model twice
(live, loaded with ``CKPT_LIVE``; reference, loaded with ``CKPT_NEXT`` by vLLM), places the
rank's windows of ``CKPT_NEXT`` into the live model and prints one JSON line of findings.

The windows are cut here by the core planner's rules for ``TargetLayout(full_tensors=False)``
(``tests/layout/_planner_harness.expected_window``), independently of the parameter map: rows
of column-parallel and expert fc1 tensors, columns of row-parallel and expert fc2 tensors, the
planner's vocabulary band, and under announced EP the contiguous block of whole experts.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def window(name, full, cfg, c):
    """What the planner sends rank ``c`` of HF tensor ``name`` (None: not this rank's expert)."""
    from mx_refit_vllm.params import planner_vocab_window

    T, t = c["tp_size"], c["tp_rank"]
    if ".experts." in name:
        expert = int(name.split(".experts.")[1].split(".")[0])
        if c["ep_size"] > 1:
            per = cfg["num_experts"] // c["ep_size"]
            return full if c["ep_rank"] * per <= expert < (c["ep_rank"] + 1) * per else None
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        lo, hi = planner_vocab_window(full.shape[0], T, t)
        return full[lo:hi]
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                      "up_proj.weight")):
        return full.chunk(T, dim=0)[t]
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return full.chunk(T, dim=1)[t]
    return full  # norms, the router


def main() -> None:
    rank, world, ep = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
    dist_init, live_dir, next_dir = sys.argv[4:7]
    import torch
    from safetensors.torch import load_file
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import initialize_model

    from mx_refit_vllm.layout import worker_coordinates
    from mx_refit_vllm.params import ParamMap

    parallel = ParallelConfig(tensor_parallel_size=world, enable_expert_parallel=ep)
    vc = VllmConfig(
        model_config=ModelConfig(
            model=live_dir, dtype="float32", enforce_eager=True, skip_tokenizer_init=True
        ),
        parallel_config=parallel,
        device_config=DeviceConfig(device="cpu"),
    )
    cfg = json.load(open(os.path.join(live_dir, "config.json")))
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=dist_init)
        initialize_model_parallel(world, 1, backend="gloo")
        live = initialize_model(vllm_config=vc)
        live.load_weights(list(load_file(os.path.join(live_dir, "model.safetensors")).items()))
        reference = initialize_model(vllm_config=vc, prefix="reference")
        reference.load_weights(list(load_file(os.path.join(next_dir, "model.safetensors")).items()))
        coords = worker_coordinates(parallel)
        pm = ParamMap(live, coords["tp_rank"], coords["tp_size"], coords["ep_size"])
        wrong_ep = ParamMap(live, coords["tp_rank"], coords["tp_size"], 1 if coords["ep_size"] > 1 else 2)
    windows = [(n, w.clone()) for n, full in load_file(os.path.join(next_dir, "model.safetensors")).items()
               if (w := window(n, full, cfg, coords)) is not None]
    live_p, ref_p = dict(live.named_parameters()), dict(reference.named_parameters())
    differ_before = [n for n in live_p if not torch.equal(live_p[n], ref_p[n])]
    placed, rest = pm.place(windows)
    mismatched = [
        n for n in live_p if not torch.equal(live_p[n].view(torch.uint8), ref_p[n].view(torch.uint8))
    ]
    expert_params = [p for n, p in live_p.items() if n.endswith(("w13_weight", "w2_weight"))]
    # receive_mode direct: the same windows again, into zeroed parameters, in pieces of 3 rows
    # through the row writers (what the core's chunking hands a window larger than its buffer).
    for p in live_p.values():
        p.data.zero_()
    writers = pm.row_writers([(n, tuple(w.shape), str(w.dtype)) for n, w in windows])
    for n, w in windows:
        for first in range(0, w.shape[0], 3) if n in writers else ():
            writers[n](first, w[first : first + 3])
    row_mismatched = [
        n for n in live_p if not torch.equal(live_p[n].view(torch.uint8), ref_p[n].view(torch.uint8))
    ]
    print(json.dumps({
        "coords": coords,
        "unproven": pm.unproven,
        "moe_layers": sorted(pm.moe),
        "w13_shape": list(expert_params[0].shape),
        "differ_before": len(differ_before),
        "compared": len(live_p),
        "mismatched": mismatched,
        "row_mismatched": row_mismatched,
        "row_unwritten": [n for n, _ in windows if n not in writers],
        "rest": [n for n, _ in rest],
        "placed_bytes": placed,
        "window_bytes": sum(w.numel() * w.element_size() for _, w in windows),
        "expert_window_bytes": sum(w.numel() * w.element_size() for n, w in windows if ".experts." in n),
        "expert_param_bytes": sum(p.numel() * p.element_size() for p in expert_params),
        "wrong_ep_unproven": wrong_ep.unproven,
        "wrong_ep_whole": list(wrong_ep.whole_prefixes()),
    }), flush=True)


if __name__ == "__main__":
    main()
