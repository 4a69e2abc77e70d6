"""The public surface plugins build on (README "Writing a plugin"): the root's lazy exports, any
Catalog for Publisher/Receiver, wait_ready/wait_retired, the shared transport, start_catalog, and
configs from a mapping that reach every constructor. Real catalog (in-process service and gRPC on
127.0.0.1) and real NIXL agents throughout."""

from __future__ import annotations

import dataclasses

import mx_refit
import pytest
import torch
from mx_refit import hookimpl
from mx_refit.catalog import CatalogClient, CatalogService
from mx_refit.config import CatalogConfig, RoleOverrideConfig, WeightSyncConfig, as_dict, load_config
from mx_refit.errors import FailedPrecondition, InvalidArgument
from mx_refit.plugins import Hooks, PluginLoadError
from mx_refit.types import MeshPosition, PublishedTensor, Role, SourceInfo, TargetLayout, TensorDescriptor


def test_root_exports_the_front_door():
    for name in ("Publisher", "Receiver", "RefitResult", "Hooks", "Catalog", "shared_transport",
                 "start_catalog", "BridgedModel", "mesh_position", "is_publishing_rank", "load_config"):
        assert name in mx_refit.__all__ and getattr(mx_refit, name) is not None
    assert mx_refit.Publisher is __import__("mx_refit.publisher").publisher.Publisher
    with pytest.raises(AttributeError, match="no attribute 'Publsher'"):
        mx_refit.Publsher  # noqa: B018


def test_publisher_and_receiver_take_an_in_process_catalog(mx_model_name):
    """A CatalogService (no gRPC at all) is a Catalog: a full publish/refit cycle over NIXL."""
    service = CatalogService()
    weight = torch.arange(16, dtype=torch.float32)
    with mx_refit.Publisher(service, mx_model_name) as pub, mx_refit.Receiver(service, mx_model_name) as rec:
        assert pub.client is service and rec.client is service
        pub.publish(1, [PublishedTensor("w", weight)])
        pub.wait_ready(1, timeout_s=30)
        (name, got), = rec.refit(1).tensors
        assert name == "w" and torch.equal(got, weight)
        pub.wait_drained(1, timeout_s=30)
    assert service.list_versions(mx_model_name)[0].state.value == "RETIRED"


def test_a_non_catalog_is_refused_by_name():
    class NotACatalog:
        address = "127.0.0.1:1"

    with pytest.raises(InvalidArgument, match=r"catalog: a .*NotACatalog is neither .*'register_source'.*pass its \.address"):
        mx_refit.Publisher(NotACatalog(), "m")
    with pytest.raises(InvalidArgument, match="catalog: a builtins.int"):
        mx_refit.Receiver(5, "m")


def test_wait_ready_waits_for_every_rank(mx_catalog, mx_model_name):
    client = CatalogClient(mx_catalog)
    ranks = [
        mx_refit.Publisher(client, mx_model_name, mesh=MeshPosition(tp_rank=r, tp_size=2), expected_sources=2)
        for r in range(2)
    ]
    try:
        with pytest.raises(TimeoutError, match=rf"version 4 of '{mx_model_name}' not READY .*not registered"):
            ranks[0].wait_ready(4, timeout_s=0.1)
        ranks[0].publish(4, [PublishedTensor("x", torch.zeros(2), Role.COLUMN, (4,), 0, 0)])
        with pytest.raises(TimeoutError, match=r"not READY after .*PENDING, 1/2 sources ready"):
            ranks[0].wait_ready(4, timeout_s=0.3)
        ranks[1].publish(4, [PublishedTensor("x", torch.ones(2), Role.COLUMN, (4,), 0, 2)])
        ranks[0].wait_ready(4, timeout_s=30)
        ranks[0].wait_drained(4, timeout_s=30)
        with pytest.raises(FailedPrecondition, match="is RETIRED; it will not become READY"):
            ranks[1].wait_ready(4, timeout_s=30)
    finally:
        for p in ranks:
            p.close()


def test_shared_transport_is_one_agent_for_the_process(mx_catalog, mx_model_name):
    """Receivers of two models in one worker share one agent; so do the trainer's publishers
    (a second process's worth of agent here: NIXL does not read from its own agent)."""
    from mx_refit.transport.nixl import NixlTransport

    shared = mx_refit.shared_transport()
    assert mx_refit.shared_transport() is shared
    trainer = NixlTransport("front-door-trainer")
    a, b = torch.arange(8.0), torch.arange(4.0) * 3
    pubs = [mx_refit.Publisher(mx_catalog, f"{mx_model_name}-{m}", transport=trainer) for m in "ab"]
    recs = [mx_refit.Receiver(mx_catalog, f"{mx_model_name}-{m}", transport=shared) for m in "ab"]
    try:
        pubs[0].publish(1, [PublishedTensor("a", a)])
        pubs[1].publish(1, [PublishedTensor("b", b)])
        assert torch.equal(recs[0].refit(1).tensors[0][1], a)
        assert torch.equal(recs[1].refit(1).tensors[0][1], b)
        arenas = [(r._arena.data_ptr(), r._arena.numel()) for r in recs]
        assert all(shared.is_registered(addr, n) for addr, n in arenas)
    finally:
        for endpoint in recs + pubs:
            endpoint.close()
    # nobody closed the shared agents; each endpoint took back only its own registrations
    assert mx_refit.shared_transport() is shared
    assert not any(shared.is_registered(addr, n) for addr, n in arenas)
    assert not any(trainer.is_registered(t.data_ptr(), t.numel() * t.element_size()) for t in (a, b))
    trainer.close()


def test_start_catalog_binds_any_host_and_advertises_a_routable_address(mx_model_name):
    server = mx_refit.start_catalog(host="0.0.0.0")
    try:
        host = server.address.rsplit(":", 1)[0]
        assert host not in ("0.0.0.0", "", "::") and server.port > 0
        CatalogClient(server.address).list_versions(mx_model_name)  # dialable as advertised
        CatalogClient(f"127.0.0.1:{server.port}").list_versions(mx_model_name)  # and on loopback
    finally:
        server.stop(0)
    named = mx_refit.start_catalog(host="127.0.0.1", advertise_host="localhost")
    try:
        assert named.address == f"localhost:{named.port}"
        CatalogClient(named.address).list_versions(mx_model_name)
    finally:
        named.stop(0)


# ----------------------------------------------------------------------------- config


def test_load_config_from_a_mapping_keeps_plugin_namespaces():
    cfg = load_config({"weight_sync": {
        "model_name": "qwen", "lease_ttl_s": 5, "full_tensors": False,
        "nemo_rl": {"refit_buffer_gib": 4}, "dynamo": {"namespace": "dyn"},
        "role_overrides": [{"role": "row", "pattern": "*.fc2.weight"}],
    }})
    assert (cfg.model_name, cfg.lease_ttl_s, cfg.full_tensors) == ("qwen", 5.0, False)
    assert cfg.plugin_settings == {"nemo_rl": {"refit_buffer_gib": 4}, "dynamo": {"namespace": "dyn"}}
    assert cfg.role_overrides == [RoleOverrideConfig(role="row", pattern="*.fc2.weight")]
    assert load_config({"model_name": "direct"}).model_name == "direct"  # the block itself works too


def test_load_config_takes_omegaconf_and_resolves_interpolations():
    from omegaconf import OmegaConf

    root = OmegaConf.create({"policy": {"name": "llama"}, "weight_sync": {"model_name": "${policy.name}"}})
    assert load_config(root).model_name == "llama"
    assert load_config(root.weight_sync).model_name == "llama"


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"lease_tll_s": 3}, r"weight_sync.lease_tll_s: unknown key .*did you mean 'lease_ttl_s'\?"),
        ({"catalog": {"adress": "h:1"}}, r"weight_sync.catalog.adress: unknown key .*did you mean 'address'\?"),
        ({"catalgo": {"mode": "standalone"}}, r"weight_sync.catalgo: unknown key .*did you mean 'catalog'\?"),
        ({"role_overrides": [{"role": "row", "patern": "x"}]}, r"role_overrides\[0\].patern: .*did you mean 'pattern'"),
        ({"verbose": True}, r"weight_sync.verbose: unknown key .*plugin's settings go in a mapping"),
        ({"full_tensors": "yes"}, r"weight_sync.full_tensors: 'yes' \(expected true or false\)"),
        ({"transfer_timeout_s": "fast"}, r"weight_sync.transfer_timeout_s: 'fast' \(expected a number\)"),
        ({"plugins": "vllm"}, r"weight_sync.plugins: 'vllm' \(expected a list\)"),
        ({"plugins": [""]}, r"weight_sync.plugins\[0\]: ''"),
        ({"catalog": {"port": 70000}}, r"weight_sync.catalog.port: 70000 out of range"),
        ({"catalog": {"store": "redis://h:6379/zero"}}, r"weight_sync.catalog.store: .redis://h:6379/zero. has database .zero."),
        ({"catalog": {"stor": "memory"}}, r"weight_sync.catalog.stor: unknown key .*did you mean .store.\?"),
        ({"method": "nccl"}, r"weight_sync.method: 'nccl'"),
        ({"receive_mode": "stage"}, r"weight_sync.receive_mode: 'stage' \(expected 'staged' or 'direct'\)"),
        ({"receive_buffer_bytes": 100}, r"weight_sync.receive_buffer_bytes: 100 \(expected an integer >= 4096\)"),
    ],
)
def test_load_config_names_the_field(block, message):
    with pytest.raises(InvalidArgument, match=message):
        load_config(block)


class _Seen:
    def __init__(self) -> None:
        self.settings: list[dict] = []

    @hookimpl
    def mx_refit_configure(self, settings):
        self.settings.append(settings)

    @hookimpl
    def mx_refit_register_role_overrides(self, register):
        register(role="column", pattern="*.q.weight")


def _one_source() -> SourceInfo:
    tensor = TensorDescriptor(name="w", dtype="float32", global_shape=(2,), local_shape=(2,), addr=0x1000, nbytes=8)
    return SourceInfo(source_id="s0", mesh=MeshPosition(), agent_name="a0", agent_metadata=b"m", tensors=(tensor,))


def _every_key_set(address: str) -> WeightSyncConfig:
    """A config with a non-default value in every key."""
    return WeightSyncConfig(
        method="mx", model_name="every-key",
        catalog=CatalogConfig(mode="standalone", address=address, host="0.0.0.0", port=0,
                              advertise_host="localhost", token=None),
        transfer_timeout_s=7.0, lease_ttl_s=9.0, source_ttl_s=6.0, drain_timeout_s=8.0, full_tensors=False,
        plugins=[], role_overrides=[RoleOverrideConfig(role="row", pattern="*.fc2.weight")],
        plugin_settings={"myplugin": {"knob": 1}}, transport="nixl", checksums=True, checksum_block_bytes=8192,
        fanout="tree", max_readers_per_source=2, publish_format="fp8_block", delta="auto", delta_anchor_every=3,
        receive_buffer_bytes=8192,  # receive_mode direct (tests/receive/test_direct.py) clashes with fanout here
    )


# Where every key of the schema takes effect; test_every_config_key_is_consumed checks each, and
# that no key is missing here.
CONSUMED = {
    "method": "validate: only 'mx'",
    "receive_mode": "Receiver.from_config receive_mode (staged | direct); vLLM's MxInitInfo.receive_mode",
    "receive_buffer_bytes": "Receiver.from_config receive_buffer_bytes (direct); vLLM's MxInitInfo.receive_buffer_bytes",
    "model_name": "Publisher/Receiver.from_config model",
    "catalog": "from_config catalog (address, token); start_catalog(config=) (host, port, advertise_host, token)",
    "transfer_timeout_s": "Receiver.transfer_timeout_s",
    "lease_ttl_s": "Receiver.lease_ttl_s",
    "source_ttl_s": "Publisher.ttl_s",
    "drain_timeout_s": "Publisher.drain_timeout_s",
    "full_tensors": "Receiver.target.full_tensors",
    "plugins": "Hooks(allow=...)",
    "role_overrides": "Hooks.role_overrides() via configure",
    "plugin_settings": "Hooks.configure settings",
    "transport": "Publisher/Receiver transport_mode (the routing transport's mode)",
    "checksums": "Publisher/Receiver.checksums",
    "checksum_block_bytes": "Publisher.checksum_block_bytes (the block size it publishes)",
    "fanout": "Receiver.fanout (offers its arena as a replica, reads replicas)",
    "max_readers_per_source": "Receiver.max_readers_per_source (sent with each lease)",
    "publish_format": "Publisher.publish_format (quantises linear weights; 'w' below is 1-D and stays as is)",
    "delta": "Publisher (its DeltaTracker) and Receiver.delta",
    "delta_anchor_every": "Publisher's DeltaTracker.anchor_every",
}
CATALOG_CONSUMED = {"mode", "address", "host", "port", "advertise_host", "token", "store"}


def test_every_config_key_is_consumed(mx_catalog, tmp_path):
    assert {f.name for f in dataclasses.fields(WeightSyncConfig)} == set(CONSUMED)
    assert {f.name for f in dataclasses.fields(CatalogConfig)} == CATALOG_CONSUMED
    cfg = _every_key_set(mx_catalog)
    seen = _Seen()
    hooks = Hooks()
    hooks.register(seen)
    pub = mx_refit.Publisher.from_config(cfg, mesh=MeshPosition(), expected_sources=1, hooks=hooks)
    rec = mx_refit.Receiver.from_config(cfg, hooks=hooks)
    try:
        assert (pub.model, pub.ttl_s, pub.drain_timeout_s) == ("every-key", 6.0, 8.0)
        assert (rec.model, rec.transfer_timeout_s, rec.lease_ttl_s) == ("every-key", 7.0, 9.0)
        assert pub.transport.mode == rec.transport.mode == "nixl"
        assert pub.checksums and rec.checksums and pub.checksum_block_bytes == 8192
        assert pub.publish_format == "fp8_block"
        assert rec.target == TargetLayout(full_tensors=False)
        assert (rec.fanout, rec.max_readers_per_source) == ("tree", 2)
        assert (rec.receive_mode, rec.receive_buffer_bytes) == ("staged", 8192)
        assert rec.delta == "auto" and pub._delta is not None and pub._delta.anchor_every == 3
        assert seen.settings[-1] == as_dict(cfg) and seen.settings[-1]["plugin_settings"] == {"myplugin": {"knob": 1}}
        overrides = hooks.role_overrides()  # the plugin's rule, then the config's
        assert overrides.lookup("a.fc2.weight", "Linear").role is Role.ROW
        assert overrides.lookup("a.q.weight", "Linear").role is Role.COLUMN
        weight = torch.arange(6.0)
        pub.publish(1, [PublishedTensor("w", weight)])
        result = rec.refit(1)
        assert torch.equal(result.tensors[0][1], weight)  # through catalog.address
        assert result.stats.blocks_verified == 1
        assert rec.replica.version == 1  # fanout: tree offered the arena as a replica
    finally:
        rec.close()
        pub.close()

    # catalog.host / port / advertise_host / token start the embedded catalog, which fills in the address
    embedded = dataclasses.replace(cfg, catalog=CatalogConfig(mode="embedded", host="0.0.0.0", advertise_host="localhost", token="s3cret"))
    server = mx_refit.start_catalog(config=embedded)
    try:
        assert embedded.catalog.address == server.address == f"localhost:{server.port}"
        with mx_refit.Publisher.from_config(embedded, mesh=None, expected_sources=1, hooks=Hooks()) as authed:
            assert authed.client.list_versions("every-key") == []  # the config's token was sent
        with pytest.raises(Exception, match="[Tt]oken|UNAUTHENTICATED|[Uu]nauthenticated"):
            CatalogClient(server.address, retries=0).list_versions("every-key")
    finally:
        server.stop(0)

    # catalog.store: the embedded catalog keeps its state there (a restarted one finds it again)
    from redis_server import RedisServer

    redis = RedisServer(tmp_path)
    try:
        stored = dataclasses.replace(cfg, catalog=CatalogConfig(mode="embedded", store=redis.url))
        for restart in range(2):
            server = mx_refit.start_catalog(config=stored)
            try:
                assert server.service.store.url == redis.url
                with CatalogClient(server.address) as client:
                    if restart == 0:
                        client.register_source("every-key", 1, 1, _one_source(), ttl_s=60)
                    assert [v.version for v in client.list_versions("every-key")] == [1]
            finally:
                server.stop(0)
                server.service.store.close()
    finally:
        redis.stop()

    # catalog.mode: embedded without an address cannot be dialled
    with pytest.raises(InvalidArgument, match="weight_sync.catalog.address: None; with catalog.mode 'embedded'"):
        mx_refit.Publisher.from_config(WeightSyncConfig(), mesh=None, expected_sources=1)


def test_the_plugin_allow_list_of_a_config_takes_effect(monkeypatch, mx_catalog):
    monkeypatch.delenv("MX_REFIT_PLUGINS", raising=False)
    cfg = dataclasses.replace(_every_key_set(mx_catalog), plugins=["no-such-plugin"])
    with pytest.raises(PluginLoadError, match=r"weight_sync.plugins names \['no-such-plugin'\]"):
        mx_refit.Receiver.from_config(cfg)
