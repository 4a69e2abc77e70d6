"""One test per hook (the meta-test in test_plugins.py insists), through the real publisher,
receiver, embedded gRPC catalog and NIXL agents wherever the hook is called from them."""

from __future__ import annotations

import pytest
import torch

from mx_refit import hookimpl
from mx_refit.catalog.client import CatalogClient
from mx_refit.errors import FailedPrecondition, InvalidArgument, NotFound
from mx_refit.plan import plan_full_tensors
from mx_refit.plugins import Hooks
from mx_refit.publisher import Publisher
from mx_refit.receive.receiver import Receiver
from mx_refit.types import MeshPosition, PublishedTensor, RefitStats, Role, TargetLayout


@pytest.fixture
def pair(mx_catalog, mx_model_name):
    """A publisher and a receiver in this process (two NIXL agents), sharing one Hooks."""
    hooks = Hooks()
    pub = Publisher(mx_catalog, mx_model_name, hooks=hooks)
    rec = Receiver(mx_catalog, mx_model_name, hooks=hooks)
    yield hooks, pub, rec
    rec.close()
    pub.close()


def test_hook_mx_refit_configure():
    hooks = Hooks()
    hooks.configure({"catalog": "127.0.0.1:1"})
    seen = []

    class Late:
        @hookimpl
        def mx_refit_configure(self, settings):
            seen.append(settings)

    hooks.register(Late())  # registered after the call: historic replay delivers it
    assert seen == [{"catalog": "127.0.0.1:1"}]


def test_hook_mx_refit_register_role_overrides():
    hooks = Hooks()
    rules = []

    class Overrides:
        @hookimpl
        def mx_refit_register_role_overrides(self, register):
            register(role=Role.ROW, pattern="decoder.*.my_proj.weight")
            register(role="column", module_class="MyColumnLinear", shard_axis=0)

    hooks.register(Overrides())
    hooks.register_role_overrides(lambda **rule: rules.append(rule))
    assert {"role": Role.ROW, "pattern": "decoder.*.my_proj.weight"} in rules
    assert {"role": "column", "module_class": "MyColumnLinear", "shard_axis": 0} in rules

    # The registry classifiers receive: plugin rules, then the config's (which win).
    registry = hooks.role_overrides()
    assert registry.lookup("decoder.layers.3.my_proj.weight", "Linear").role is Role.ROW
    assert registry.lookup("decoder.layers.3.other.weight", "MyColumnLinear").role is Role.COLUMN
    assert registry.lookup("decoder.layers.3.other.weight", "Linear") is None
    hooks.configure({"role_overrides": [{"role": "replicated", "pattern": "decoder.*.my_proj.weight"}]})
    assert hooks.role_overrides().lookup("decoder.layers.3.my_proj.weight", "Linear").role is Role.REPLICATED


def test_hook_mx_refit_collect_tensors(pair):
    hooks, pub, rec = pair
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)

    class Wrapper:  # a framework model object only its plugin understands
        def __init__(self, w):
            self.w = w

    class FrameworkPlugin:
        @hookimpl
        def mx_refit_collect_tensors(self, model, mesh):
            if isinstance(model, Wrapper):
                return [PublishedTensor("w", model.w)]
            return None

    with pytest.raises(TypeError, match="no mx-refit plugin can collect tensors"):
        hooks.collect_tensors(Wrapper(weight), MeshPosition())
    hooks.register(FrameworkPlugin())
    collected = hooks.collect_tensors(Wrapper(weight), MeshPosition())
    assert collected[0].tensor.data_ptr() == weight.data_ptr()  # in place, never a copy
    # the built-in collector still handles plain mappings and modules
    assert [t.name for t in hooks.collect_tensors(torch.nn.Linear(2, 2, bias=False), MeshPosition())] == ["weight"]

    pub.publish(1, model=Wrapper(weight))
    (name, tensor), = rec.refit(1).tensors
    assert name == "w" and torch.equal(tensor, weight)


def test_hook_mx_refit_build_sidecar(pair, mx_catalog):
    hooks, pub, rec = pair

    class A:
        @hookimpl
        def mx_refit_build_sidecar(self, model, mesh):
            return {"framework": {"name": "toy", "tp": mesh.tp_size}}

    class B:
        @hookimpl
        def mx_refit_build_sidecar(self, model, mesh):
            return {"hf_names": ["w"]}

    hooks.register(A())
    hooks.register(B())
    pub.publish(1, model={"w": torch.ones(4)})
    assert rec.discover(1).sidecar == {"framework": {"name": "toy", "tp": 1}, "hf_names": ["w"]}

    class Conflicting:
        @hookimpl
        def mx_refit_build_sidecar(self, model, mesh):
            return {"hf_names": ["other"]}

    hooks.register(Conflicting())
    with pytest.raises(ValueError, match="'hf_names' is contributed twice"):
        hooks.build_sidecar({}, MeshPosition())


def test_hook_mx_refit_target_layout():
    hooks = Hooks()
    assert hooks.target_layout(object()) == TargetLayout()

    class Engine:
        tp = (1, 4)

    class EnginePlugin:
        @hookimpl
        def mx_refit_target_layout(self, engine):
            return TargetLayout(tp_rank=engine.tp[0], tp_size=engine.tp[1]) if isinstance(engine, Engine) else None

    hooks.register(EnginePlugin())
    assert hooks.target_layout(Engine()) == TargetLayout(tp_rank=1, tp_size=4)


def test_hook_mx_refit_plan_receive(pair):
    hooks, pub, rec = pair
    pub.publish(1, [PublishedTensor("a", torch.arange(8.0)), PublishedTensor("b", torch.ones(2, 2))])
    planned = []

    class OnlyA:  # a planner plugin that pulls a subset
        @hookimpl
        def mx_refit_plan_receive(self, version, target):
            full = plan_full_tensors(version)
            keep = [p for p in full.placements if p.name == "a"]
            full.placements = keep
            full.reads = [r for r in full.reads if r.local_offset == keep[0].offset]
            planned.append(version.version)
            return full

    hooks.register(OnlyA())
    result = rec.refit(1)
    assert planned == [1]
    assert [n for n, _ in result.tensors] == ["a"] and torch.equal(result.tensors[0][1], torch.arange(8.0))
    assert result.stats.bytes_pulled == 32


def test_hook_mx_refit_load_weights(mx_catalog, mx_model_name):
    hooks = Hooks()
    loaded, around = [], []

    class Engine:
        def load_weights(self, weights):
            loaded.extend((n, t.clone()) for n, t in weights)

    class Pause:  # a wrapper, e.g. an engine pausing generation around each load
        @hookimpl(wrapper=True)
        def mx_refit_load_weights(self, engine, weights):
            around.append("pause")
            result = yield
            around.append("resume")
            return result

    hooks.register(Pause())
    tensors = {f"t{i}": torch.full((256,), float(i)) for i in range(4)}
    with Publisher(mx_catalog, mx_model_name, hooks=hooks) as pub, Receiver(
        mx_catalog, mx_model_name, engine=Engine(), hooks=hooks, load_batch_bytes=2048
    ) as rec:
        pub.publish(1, [PublishedTensor(n, t) for n, t in tensors.items()])
        rec.refit(1)
    assert sorted(n for n, _ in loaded) == sorted(tensors)
    assert all(torch.equal(t, tensors[n]) for n, t in loaded)
    assert around == ["pause", "resume"] * 2  # 4 KiB in batches of at most 2 KiB

    target = {"t0": torch.zeros(256)}
    hooks.load_weights(target, [("t0", tensors["t0"])])
    assert torch.equal(target["t0"], tensors["t0"])
    with pytest.raises(TypeError, match="cannot|no mx-refit plugin can load"):
        Hooks().load_weights(object(), [])


def test_hook_mx_refit_direct_targets(mx_catalog, mx_model_name):
    """receive_mode direct asks the engine once, before the first byte: its row writers take the
    tensors larger than the buffer in pieces, the rest come whole through load_weights; raising
    refuses the version with the engine untouched."""
    params = {"big": torch.zeros(64, 32), "small": torch.zeros(8)}
    asked, pieces, whole = [], [], []

    class Engine:
        def load_weights(self, weights):
            for name, tensor in weights:
                whole.append(name)
                params[name].copy_(tensor)

    class Rows:
        refuse = False

        @hookimpl
        def mx_refit_direct_targets(self, engine, tensors):
            asked.append(sorted(tensors))
            if self.refuse:
                raise InvalidArgument("engine: no such tensors")

            def write(first, rows):
                pieces.append((first, rows.shape[0]))
                params["big"][first : first + rows.shape[0]].copy_(rows)

            return {"big": write}

    rows = Rows()
    hooks = Hooks()
    hooks.register(rows)
    big, small = torch.randn(64, 32), torch.randn(8)
    with Publisher(mx_catalog, mx_model_name, hooks=hooks) as pub, Receiver(
        mx_catalog, mx_model_name, engine=Engine(), hooks=hooks, receive_mode="direct", receive_buffer_bytes=4096
    ) as rec:
        pub.publish(1, [PublishedTensor("big", big), PublishedTensor("small", small)])
        rows.refuse = True
        with pytest.raises(InvalidArgument, match="no such tensors"):
            rec.refit(1)
        assert not pieces and not whole and not params["big"].any()  # refused before any byte
        rows.refuse = False
        stats = rec.refit(1).stats
    assert asked[-1] == [("big", (64, 32), "float32"), ("small", (8,), "float32")]
    assert torch.equal(params["big"], big) and torch.equal(params["small"], small)
    assert whole == ["small"] and len(pieces) == stats.chunks == 3  # 8 KiB through 4 KiB: rows 0-30, 31-61, 62-63 + small
    assert sum(n for _, n in pieces) == 64


def test_hook_mx_refit_version_published(pair):
    hooks, pub, rec = pair
    seen = []

    class Watch:
        @hookimpl
        def mx_refit_version_published(self, model, version, source_id, mesh):
            seen.append((model, version, source_id, mesh))

    hooks.register(Watch())
    pub.publish(3, [PublishedTensor("x", torch.zeros(3))])
    assert seen == [(pub.model, 3, pub.source_id, MeshPosition())]


def test_hook_mx_refit_version_ready(mx_catalog, mx_model_name):
    hooks = Hooks()
    ready = []

    class Watch:
        @hookimpl
        def mx_refit_version_ready(self, model, version):
            ready.append(version)

    hooks.register(Watch())
    ranks = [
        Publisher(mx_catalog, mx_model_name, mesh=MeshPosition(tp_rank=r, tp_size=2), expected_sources=2, hooks=hooks)
        for r in range(2)
    ]
    try:
        ranks[0].publish(1, [PublishedTensor("x", torch.zeros(2), Role.COLUMN, (4,), 0, 0)])
        assert ready == []  # one of two ranks: still PENDING
        ranks[1].publish(1, [PublishedTensor("x", torch.ones(2), Role.COLUMN, (4,), 0, 2)])
        assert ready == [1]
    finally:
        for p in ranks:
            p.close()


def test_hook_mx_refit_refit_done(pair):
    hooks, pub, rec = pair
    stats: list[RefitStats] = []

    class Watch:
        @hookimpl
        def mx_refit_refit_done(self, stats):
            stats_list.append(stats)

    stats_list = stats
    hooks.register(Watch())
    pub.publish(1, [PublishedTensor("x", torch.zeros(1024))])
    rec.refit(1)
    (s,) = stats
    assert (s.version, s.tensors, s.bytes_pulled, s.bytes_needed, s.sources) == (1, 1, 4096, 4096, 1)
    assert s.seconds > 0 and s.gbps > 0 and s.descriptors == 1


class _Lifecycle:
    """Records the retire/drain/failure notifications."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    @hookimpl
    def mx_refit_version_retired(self, model, version):
        self.seen.append(("retired", model, version))

    @hookimpl
    def mx_refit_version_drained(self, model, version):
        self.seen.append(("drained", model, version))

    @hookimpl
    def mx_refit_refit_failed(self, model, version, error):
        self.seen.append(("failed", model, version, error))


def test_hook_mx_refit_version_retired(pair):
    hooks, pub, rec = pair
    watch = _Lifecycle()
    hooks.register(watch)
    pub.publish(1, [PublishedTensor("x", torch.zeros(4))])
    rec.refit(1)
    assert watch.seen == []
    pub.wait_drained(1, timeout_s=30)
    assert watch.seen == [("retired", pub.model, 1), ("drained", pub.model, 1)]
    with pytest.raises((NotFound, FailedPrecondition)):  # retired: offered to no new reader
        rec.discover(1)


def test_hook_mx_refit_version_drained(mx_catalog, mx_model_name):
    """A reader holding a lease delays the drain; a second rank that only waits (wait_retired)
    hears of the drain too, without retiring anything itself."""
    hooks = Hooks()
    watch = _Lifecycle()
    hooks.register(watch)
    client = CatalogClient(mx_catalog)
    ranks = [
        Publisher(client, mx_model_name, mesh=MeshPosition(tp_rank=r, tp_size=2), expected_sources=2, hooks=hooks)
        for r in range(2)
    ]
    try:
        for r, rank in enumerate(ranks):
            rank.publish(1, [PublishedTensor("x", torch.full((2,), float(r)), Role.COLUMN, (4,), 0, 2 * r)])
        ranks[1].wait_ready(1, timeout_s=30)
        lease = client.acquire_lease(model=mx_model_name, version=1, reader_id="slow-reader", ttl_s=60)
        with pytest.raises(TimeoutError, match=rf"version 1 of '{mx_model_name}' still has live reader leases"):
            ranks[0].wait_drained(1, timeout_s=0.2)
        assert [s[0] for s in watch.seen] == ["retired"]
        with pytest.raises(TimeoutError, match=r"not retired after .*DRAINING"):
            ranks[1].wait_retired(1, timeout_s=0.3)
        client.release_lease(lease_id=lease)
        ranks[1].wait_retired(1, timeout_s=30)
        assert watch.seen[1:] == [("drained", mx_model_name, 1)]
    finally:
        for p in ranks:
            p.close()


def test_hook_mx_refit_refit_failed(pair):
    hooks, pub, rec = pair
    watch = _Lifecycle()
    hooks.register(watch)
    with pytest.raises(NotFound):
        rec.refit(7)  # nothing published: discovery fails
    (event,) = watch.seen
    assert event[:3] == ("failed", rec.model, 7) and isinstance(event[3], NotFound)

    pub.publish(1, [PublishedTensor("x", torch.arange(4.0))])
    before = rec.refit(1)

    class BrokenPlanner:  # a planner that claims more bytes than the source holds
        @hookimpl(tryfirst=True)
        def mx_refit_plan_receive(self, version, target):
            plan = plan_full_tensors(version)
            plan.reads[0] = plan.reads[0]._replace(local_offset=plan.arena_bytes)
            return plan

    hooks.register(BrokenPlanner())
    pub.publish(2, [PublishedTensor("x", torch.arange(4.0) + 10)])
    with pytest.raises(InvalidArgument, match="exceeds"):
        rec.refit(2)
    assert watch.seen[-1][:3] == ("failed", rec.model, 2) and isinstance(watch.seen[-1][3], InvalidArgument)
    assert torch.equal(before.tensors[0][1], torch.arange(4.0))  # the previous weights are untouched
