"""A rejected call changes nothing, and its message names the field (real embedded catalog)."""

from __future__ import annotations

import pytest
import torch

from mx_refit.catalog.client import CatalogClient
from mx_refit.errors import InvalidArgument
from mx_refit.publisher import Publisher
from mx_refit.receive.receiver import Receiver
from mx_refit.types import MeshPosition, PublishedTensor, SourceInfo, VersionState


@pytest.fixture
def published(mx_catalog: str, mx_model_name: str):
    tensor = torch.arange(64, dtype=torch.float32)
    with Publisher(mx_catalog, mx_model_name) as pub:
        assert pub.publish(1, [PublishedTensor("w", tensor)]) is VersionState.READY
        yield pub


def states(client: CatalogClient, model: str) -> dict[int, str]:
    return {s.version: s.state.value for s in client.list_versions(model)}


@pytest.mark.parametrize("timeout_s", [-1, float("nan"), float("inf"), "5"])
def test_wait_drained_with_a_bad_timeout_retires_nothing(published, mx_catalog, mx_model_name, timeout_s) -> None:
    with pytest.raises(InvalidArgument, match=r"^timeout_s: "):
        published.wait_drained(1, timeout_s=timeout_s)
    with CatalogClient(mx_catalog) as client:
        assert states(client, mx_model_name) == {1: "READY"}


def test_expected_sources_out_of_range_is_named(mx_catalog, mx_model_name) -> None:
    with pytest.raises(InvalidArgument, match=r"^expected_sources: "):
        Publisher(mx_catalog, mx_model_name, expected_sources=0)
    source = SourceInfo("s", MeshPosition(), "agent", b"md", ())
    with CatalogClient(mx_catalog) as client:
        with pytest.raises(InvalidArgument, match=r"^expected_sources: 4294967296 "):
            client.register_source(mx_model_name, 1, 2**32, source)
        with pytest.raises(InvalidArgument, match=r"^version: "):
            client.register_source(mx_model_name, 2**63, 1, source)
        assert client.list_versions(mx_model_name) == []


def test_a_bad_mesh_is_invalid_argument_naming_the_field(mx_catalog, mx_model_name) -> None:
    with pytest.raises(InvalidArgument, match=r"^mesh\.tp_rank: must be in \[0, 2\), got 2"):
        Publisher(mx_catalog, mx_model_name, mesh=MeshPosition(tp_rank=2, tp_size=2))
    with pytest.raises(InvalidArgument, match=r"^mesh\.ep_size: must be >= 1"):
        MeshPosition(ep_size=0).validate()


@pytest.mark.parametrize("field", ["transfer_timeout_s", "lease_ttl_s"])
def test_receiver_timeouts_are_checked_before_discover_and_lease(published, mx_catalog, mx_model_name, field) -> None:
    with pytest.raises(InvalidArgument, match=rf"^{field}: "):
        Receiver(mx_catalog, mx_model_name, **{field: -1})
    with Receiver(mx_catalog, mx_model_name) as rec:
        with pytest.raises(InvalidArgument, match=r"^wait_s: "):
            rec.refit(wait_s=-1)
        assert [s.leases for s in rec.client.list_versions(mx_model_name)] == [0]
