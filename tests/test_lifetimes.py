"""Buffer lifetimes on the CPU path (real NIXL over UCX, real gRPC catalog): a published buffer
stays pinned while a lease is live, is released only after a drain, and a republish from new
buffers reaches the reader. Same-node DRAM sources keep reading over NIXL."""

from __future__ import annotations

import pytest
import torch

from mx_refit.errors import FailedPrecondition, TransferError
from mx_refit.publisher import Publisher
from mx_refit.receive.receiver import Receiver
from mx_refit.types import PublishedTensor

pytestmark = pytest.mark.timeout(180)


def tensors(seed: int, n: int = 3) -> list[PublishedTensor]:
    g = torch.Generator().manual_seed(seed)
    return [PublishedTensor(f"layers.{i}.weight", torch.randn(64, 32, generator=g)) for i in range(n)]


def test_release_needs_a_drain_and_a_republish_from_new_buffers_is_read(mx_catalog, mx_model_name):
    with Publisher(mx_catalog, mx_model_name) as pub, Receiver(mx_catalog, mx_model_name) as rec:
        first = tensors(1)
        pub.publish(1, first)
        lease = rec.client.acquire_lease(model=mx_model_name, version=1, reader_id="slow", ttl_s=30)
        with pytest.raises(TimeoutError, match="live reader leases"):
            pub.wait_drained(1, timeout_s=0.3)
        # The lease is live: the buffers stay pinned, and releasing them is refused.
        with pytest.raises(FailedPrecondition, match="version 1 .* has not drained"):
            pub.release_buffers()
        assert all(pub.transport.region_of(t.tensor) for t in first)
        rec.client.release_lease(lease_id=lease)
        pub.wait_drained(1, timeout_s=10)
        assert pub.release_buffers() == len(first)
        with pytest.raises(Exception, match="not registered"):
            pub.transport.region_of(first[0].tensor)

        del first  # the trainer offloads; new parameters live elsewhere
        second = tensors(2)
        registrations = pub.transport.registrations
        pub.publish(2, second)
        assert pub.transport.registrations == registrations + len(second)
        result = rec.refit(2)
        got = dict(result.tensors)
        for t in second:
            assert torch.equal(got[t.name], t.tensor), t.name
        assert result.stats.transport == "nixl" and result.stats.handles_opened == 0
        assert result.version.sources[0].cuda_ipc is None  # host memory exports no IPC handles


def test_release_before_any_publish_is_allowed_and_nixl_mode_is_honoured(mx_catalog, mx_model_name):
    with Publisher(mx_catalog, mx_model_name, transport_mode="nixl") as pub, \
            Receiver(mx_catalog, mx_model_name, transport_mode="nixl") as rec:
        assert pub.release_buffers() == 0
        ts = tensors(3, n=2)
        pub.publish(1, ts)
        result = rec.refit(1)
        assert result.stats.transport == "nixl"
        assert [n for n, _ in result.tensors] == [t.name for t in ts]


def test_a_forced_cuda_ipc_reader_names_the_source_it_cannot_serve(mx_catalog, mx_model_name):
    from mx_refit.errors import InvalidArgument

    engine: dict[str, torch.Tensor] = {}
    with Publisher(mx_catalog, mx_model_name) as pub, \
            Receiver(mx_catalog, mx_model_name, engine=engine, transport_mode="cuda_ipc") as rec:
        pub.publish(1, tensors(4))
        with pytest.raises(InvalidArgument, match="'cuda_ipc' is impossible here: the source exports no CUDA IPC"):
            rec.refit(1)
        assert engine == {}  # nothing loaded
        leases = [v.leases for v in rec.client.list_versions(model=mx_model_name)]
        assert leases == [0]  # the failed refit released its lease


def test_a_receiver_closed_during_refits_fails_them_with_one_kind_of_error(mx_catalog, mx_model_name):
    """Whichever part notices the close first (the lease, the catalog client, the transport),
    a refit running meanwhile ends in a TransferError saying so, and a later one too."""
    import random
    import threading
    import time

    rng = random.Random(5)
    with Publisher(mx_catalog, mx_model_name) as pub:
        pub.publish(1, [PublishedTensor("w", torch.randn(1 << 18))])
        for _ in range(6):
            rec = Receiver(mx_catalog, mx_model_name)
            errors: list[Exception] = []

            def cycles(rec: Receiver, errors: list[Exception]) -> None:
                while True:
                    try:
                        rec.refit(1)
                    except Exception as exc:  # the test inspects it
                        errors.append(exc)
                        return

            worker = threading.Thread(target=cycles, args=(rec, errors))
            worker.start()
            time.sleep(rng.uniform(0.005, 0.15))
            rec.close()
            worker.join(60)
            assert not worker.is_alive() and len(errors) == 1
            assert isinstance(errors[0], TransferError) and "closed" in str(errors[0]), repr(errors[0])
            with pytest.raises(TransferError, match="closed"):
                rec.refit(1)
