"""Registered regions travel with a source, and every descriptor must lie inside one."""

from __future__ import annotations

import dataclasses

import pytest

from mx_refit.catalog.convert import source_from_proto, source_to_proto
from mx_refit.errors import InvalidArgument
from mx_refit.types import MeshPosition, SourceInfo, TensorDescriptor


def _source(regions):
    return SourceInfo(
        source_id="s0",
        mesh=MeshPosition(),
        agent_name="agent",
        agent_metadata=b"md",
        tensors=(
            TensorDescriptor("a", "float32", (4,), (4,), addr=4096, nbytes=16),
            TensorDescriptor("b", "float32", (4,), (4,), addr=4112, nbytes=16),
        ),
        regions=regions,
    )


def test_regions_round_trip_through_proto():
    source = _source(((4096, 16), (4112, 16)))
    assert source_from_proto(source_to_proto(source)).regions == ((4096, 16), (4112, 16))


def test_registered_source_keeps_its_regions(make_service):
    service = make_service()
    service.register_source("m", 1, 1, dataclasses.replace(_source(((4112, 16), (4096, 16))), ready=True))
    assert service.get_version("m", 1).sources[0].regions == ((4096, 16), (4112, 16))


@pytest.mark.parametrize(
    ("regions", "message"),
    [
        (((4096, 16),), r"tensors\[1\] \('b'\).*outside every registered region"),
        (((4096, -1),), r"regions\[0\]: \(4096, -1\)"),
        ((("x", 16),), r"regions\[0\]: expected \(addr, nbytes\) integers"),
    ],
)
def test_bad_regions_are_rejected_and_change_nothing(make_service, regions, message):
    service = make_service()
    with pytest.raises(InvalidArgument, match=message):
        service.register_source("m", 1, 1, _source(regions))
    assert service.list_versions("m") == []
