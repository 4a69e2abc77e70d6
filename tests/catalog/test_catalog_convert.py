"""proto <-> domain conversions: exact round trips, complete enum tables, clear errors."""

from __future__ import annotations

import math
from typing import Any

import pytest
from catalog_factories import desc, source, tp_source

from mx_refit.catalog import VersionSummary, convert
from mx_refit.catalog.v1 import catalog_pb2 as pb
from mx_refit.catalog.validation import same_json
from mx_refit.errors import InvalidArgument
from mx_refit.types import MemType, Role, VersionInfo, VersionState

AWKWARD_JSON: dict[str, Any] = {
    "big": 2**70,
    "neg": -(2**63),
    "zero": 0,
    "float": 0.1,
    "tiny": 5e-324,
    "huge": 1.7976931348623157e308,
    "negzero": -0.0,
    "one_float": 1.0,
    "t": True,
    "f": False,
    "none": None,
    "text": 'µ-naïve "quoted" \n 漢字',
    "empty": "",
    "list": [1, 1.0, True, None, "1", [], {}],
    "nested": {"a": {"b": {"c": [{"d": 2.5}]}}},
    "": "empty key",
}


def test_enum_tables_cover_every_domain_member() -> None:
    for member in Role:
        msg = convert.descriptor_to_proto(desc(role=member))
        assert pb.Role.Name(msg.role) == f"ROLE_{member.name}"
        assert convert.descriptor_from_proto(msg).role is member
    for mem_type in MemType:
        msg = convert.descriptor_to_proto(desc(mem_type=mem_type))
        assert convert.descriptor_from_proto(msg).mem_type is mem_type
    for state in VersionState:
        assert convert.state_from_proto(convert.state_to_proto(state)) is state
    # and nothing in the proto that the domain lacks (besides UNSPECIFIED)
    assert len(pb.Role.keys()) == len(Role) + 1
    assert len(pb.MemType.keys()) == len(MemType) + 1
    assert len(pb.VersionState.keys()) == len(VersionState) + 1


def test_json_round_trip_is_exact_including_types() -> None:
    text = convert.json_to_text(AWKWARD_JSON, "extras")
    back = convert.json_from_text(text, "extras")
    assert same_json(back, AWKWARD_JSON)
    assert math.copysign(1.0, back["negzero"]) == -1.0
    assert type(back["one_float"]) is float and type(back["big"]) is int


def test_tuples_travel_as_lists() -> None:
    assert convert.json_from_text(convert.json_to_text({"t": (1, 2)}, "x"), "x") == {"t": [1, 2]}


def test_descriptor_round_trip() -> None:
    original = desc(
        "layers.0.qkv",
        dtype="bfloat16",
        global_shape=(96, 64),
        local_shape=(48, 64),
        shard_axis=0,
        shard_offset=48,
        addr=0x7F00_0000_1000,
        role=Role.QKV_COLUMN,
        mem_type=MemType.VRAM,
        device_id=3,
        extras=AWKWARD_JSON,
    )
    back = convert.descriptor_from_proto(convert.descriptor_to_proto(original))
    assert back == original
    assert same_json(back.extras, AWKWARD_JSON)


def test_source_and_version_round_trip() -> None:
    info = VersionInfo(
        model="m",
        version=2**40,
        state=VersionState.DRAINING,
        expected_sources=2,
        sources=(tp_source(0, 2, ready=True), source("s", metadata=bytes(range(256)))),
        sidecar=AWKWARD_JSON,
    )
    wire = convert.version_info_to_proto(info).SerializeToString()
    back = convert.version_info_from_proto(pb.VersionInfo.FromString(wire))
    assert back == info


def test_summary_round_trip() -> None:
    summary = VersionSummary("m", 3, VersionState.READY, 8, 8, 7, 2)
    assert convert.summary_from_proto(convert.summary_to_proto(summary)) == summary


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "sidecar: invalid JSON"),
        ("[1, 2]", "sidecar: expected a JSON object, got list"),
        ('{"x": NaN}', "sidecar: invalid JSON (NaN is not valid JSON)"),
    ],
)
def test_bad_json_from_the_wire(text: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(").replace(")", r"\)")):
        convert.json_from_text(text, "sidecar")


def test_non_json_values_are_rejected_when_encoding() -> None:
    with pytest.raises(InvalidArgument, match=r'extras\["x"\]: set value'):
        convert.json_to_text({"x": {1}}, "extras")
    with pytest.raises(InvalidArgument, match="extras: must be a mapping, got list"):
        convert.json_to_text([], "extras")  # type: ignore[arg-type]


def test_unspecified_enums_from_the_wire_are_rejected() -> None:
    msg = convert.descriptor_to_proto(desc())
    msg.role = pb.ROLE_UNSPECIFIED
    with pytest.raises(InvalidArgument, match=r"source.tensors\[4\].role: unknown or unspecified"):
        convert.descriptor_from_proto(msg, "source.tensors[4]")
    with pytest.raises(InvalidArgument, match="state: unknown or unspecified enum value 99"):
        convert.state_from_proto(99)


def test_out_of_range_integers_are_rejected_when_encoding() -> None:
    with pytest.raises(InvalidArgument, match=r"tensors\[0\]: cannot encode descriptor 'w'"):
        convert.descriptor_to_proto(desc(addr=2**64), "tensors[0]")


def test_a_lease_fence_survives_the_wire() -> None:
    from dataclasses import replace

    fenced = replace(source("s0"), lease_fence_s=60.0)
    assert convert.source_from_proto(convert.source_to_proto(fenced)).lease_fence_s == 60.0
    assert convert.source_from_proto(convert.source_to_proto(source("s0"))).lease_fence_s == 0.0
