"""The receiver's compile-target filter on hand-built versions (pure: mx_refit.compile_targets)."""

from __future__ import annotations

import dataclasses

import pytest

from mx_refit.compile_targets import check_compile_targets, version_target
from mx_refit.errors import CompileTargetError
from mx_refit.types import CompileCompat, MeshPosition, SourceInfo, TargetLayout, TensorDescriptor, VersionInfo, VersionState


def _t(name: str, target: str = "hf_raw", **meta: str) -> TensorDescriptor:
    return TensorDescriptor(name, "bfloat16", (4,), (4,), 0, 8, compile_target=target, compile_metadata=dict(meta))


def _version(*sources: tuple[str, tuple[TensorDescriptor, ...]], compat: CompileCompat | None = None) -> VersionInfo:
    infos = tuple(SourceInfo(sid, MeshPosition(), "a", b"", tensors, compat=compat) for sid, tensors in sources)
    return VersionInfo("m", 3, VersionState.READY, len(infos), infos)


def test_hf_raw_versions_pass_the_default_layout_and_report_their_target() -> None:
    info = _version(("s0", (_t("a"), _t("b"))))
    assert check_compile_targets(info, TargetLayout()) == "hf_raw"


def test_a_compiled_version_keeps_hf_raw_for_what_it_does_not_compile() -> None:
    info = _version(("s0", (_t("norm"), _t("q", "fp8_block", block_size="128,128"))))
    assert version_target(info.sources) == "fp8_block"
    layout = TargetLayout(compile_targets=("fp8_block",), required_metadata={"block_size": "128,128"})
    assert check_compile_targets(info, layout) == "fp8_block"
    with pytest.raises(CompileTargetError, match=r"tensor 'q' is offered as compile target 'fp8_block', "
                                                 r"but this receiver wants 'hf_raw'"):
        check_compile_targets(info, TargetLayout())


def test_a_target_no_source_offers_is_one_clear_error() -> None:
    info = _version(("s0", (_t("w", "vllm_fused"),)))
    with pytest.raises(CompileTargetError, match=r"tensor 'w' is offered as compile target 'vllm_fused', but this receiver wants "
                                                 r"'fp8_block' or 'trtllm'"):
        check_compile_targets(info, TargetLayout(compile_targets=("fp8_block", "trtllm")))


def test_mixed_target_versions_are_refused() -> None:
    two_targets = _version(("s0", (_t("a", "fp8_block"),)), ("s1", (_t("b", "cutlass_fp8"),)))
    with pytest.raises(CompileTargetError, match=r"mixed targets: 'cutlass_fp8' \(source 's1'\) and 'fp8_block' \(tensor 'a'"):
        check_compile_targets(two_targets, TargetLayout(compile_targets=("fp8_block", "cutlass_fp8")))
    one_tensor_two_forms = _version(("s0", (_t("a", "fp8_block"),)), ("s1", (_t("a"),)))
    with pytest.raises(CompileTargetError, match=r"tensors\['a'\]\.compile_target: mixed targets: "
                                                 r"source 's0' offers 'fp8_block', "
                                                 r"source 's1' offers 'hf_raw'"):
        check_compile_targets(one_tensor_two_forms, TargetLayout(compile_targets=("fp8_block", "hf_raw")))


def test_compat_is_compared_for_compiled_targets_only() -> None:
    theirs = CompileCompat(framework="megatron-core", gpu_arch="sm_90", torch_version="")
    mine = CompileCompat(gpu_arch="sm_100", torch_version="2.11")
    raw = _version(("s0", (_t("a"),)), compat=theirs)
    assert check_compile_targets(raw, TargetLayout(compat=mine)) == "hf_raw"  # hf_raw: never compared
    compiled = _version(("s0", (_t("a", "deepgemm_fp8"),)), compat=theirs)
    with pytest.raises(CompileTargetError, match=r"tensor 'a' \(compile target 'deepgemm_fp8'\) of source 's0' was compiled for "
                                                 r"another runtime: gpu_arch: 'sm_90' offered, 'sm_100' wanted$"):
        check_compile_targets(compiled, TargetLayout(compile_targets=("deepgemm_fp8",), compat=mine))
    same = dataclasses.replace(mine, gpu_arch="sm_90")
    assert check_compile_targets(compiled, TargetLayout(compile_targets=("deepgemm_fp8",), compat=same)) == "deepgemm_fp8"


def test_required_metadata_is_a_subset_rule() -> None:
    info = _version(("s0", (_t("a", "fp8_block", block_size="128,128", fp8_dtype="float8_e4m3fn"),)))
    ok = TargetLayout(compile_targets=("fp8_block",), required_metadata={"block_size": "128,128"})
    assert check_compile_targets(info, ok) == "fp8_block"
    missing = TargetLayout(compile_targets=("fp8_block",), required_metadata={"scale_fmt": "ue8m0"})
    with pytest.raises(CompileTargetError, match=r"compile_metadata\['scale_fmt'\] = None, but this receiver wants 'ue8m0'"):
        check_compile_targets(info, missing)
    assert TargetLayout(required_metadata={"b": "2", "a": "1"}).required_metadata == (("a", "1"), ("b", "2"))
    assert hash(TargetLayout(compile_targets=["fp8_block"])) == hash(TargetLayout(compile_targets=("fp8_block",)))
