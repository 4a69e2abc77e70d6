"""The Megatron-Core fallback (no Bridge conversion tasks) on a real local-spec GPT model:
EP 2 (2 ranks, one process each, gloo; TP splits are covered with Bridge and in the units), MoE with sequential experts, qkv bias, q/k norm;
the real Float16Module wrapper twice (``module.module.`` prefixes); config overrides winning."""

from __future__ import annotations

from mx_refit.verify.harness import launch_ranks
from tests.fixtures.megatron_jobs import local_spec_job
from tests.megatron.test_classify_bridge import expected_role


def test_local_spec_ep2_fallback_wrapped_and_overrides() -> None:
    outs = launch_ranks(local_spec_job, 2, 1, 2, timeout_s=300)
    experts_by_ep: dict[int, set[int]] = {}
    for rank, out in enumerate(outs):
        tp_rank, ep_rank = 0, rank
        assert out["bare"] == out["wrapped"], "wrapper prefixes changed the classification"
        assert all(name.startswith("module.module.") for name in out["raw_names"])
        assert out["in_place"] and out["published_in_place"]
        assert out["dtypes"] == ["torch.bfloat16"]  # Float16Module converted in place; still published
        for name, (role, axis, offset, gshape, extras, decided_by) in out["bare"].items():
            assert decided_by == "megatron"
            assert role == expected_role(name), (name, role)
            if "expert_id" in extras:
                experts_by_ep.setdefault(ep_rank, set()).add(extras["expert_id"])
                assert extras["tp_rank"] == tp_rank and extras["tp_size"] == 1
            elif axis >= 0:
                assert extras == {"tp_rank": tp_rank, "tp_size": 1}
        qkv = out["bare"]["decoder.layers.1.self_attention.linear_qkv.bias"]
        assert qkv[:4] == ("qkv_column", 0, 0, (128,))
        for name, (role, axis) in out["overridden"].items():
            if name.endswith("self_attention.linear_proj.weight"):
                assert (role, axis) == ("replicated", -1)  # the pattern beats the class override
            elif name.endswith("linear_fc2.weight"):
                assert (role, axis) == ("column", 0)  # class override beats detection (experts too)
            else:
                assert role == out["bare"][name][0]
    assert experts_by_ep == {0: {0, 1}, 1: {2, 3}}  # EP-global ids from local_experts.{0,1}
