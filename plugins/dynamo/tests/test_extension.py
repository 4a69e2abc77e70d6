"""Case 5: ``MxRefitWorkerExtension`` mixed into vLLM's Worker by vLLM's real ``init_worker``,
alone (the worker has no weight-transfer engine: the extension builds one) and composed with
Dynamo 1.6.1's ``FpmGcWorkerExtension`` (the worker runs backend ``mx``: the extension uses it),
called through Dynamo's real ``update_weights_from_distributed`` route with ``engine_rpc``."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import pytest
from conftest import DynamoWorkerProc, start_workers

from mx_refit_dynamo import DynamoRefitClient, DynamoRefitError

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def ext_workers(ckpts, log_dir) -> Iterator[dict[str, DynamoWorkerProc]]:
    alone = "--extension mx_refit_dynamo.extension.MxRefitWorkerExtension --no-engine"
    composed = "--extension _ext_classes.WithFpmGc"
    workers = [
        *start_workers([("ext-alone", 1)], ckpts[0], log_dir, worker_script="_ext_worker.py", worker_args=alone),
        *start_workers([("ext-fpm", 1)], ckpts[0], log_dir, worker_script="_ext_worker.py", worker_args=composed),
    ]
    try:
        yield {"alone": workers[0], "fpm": workers[1]}
    finally:
        for worker in workers:
            worker.stop()


@pytest.fixture(scope="module")
def published(ckpts) -> Iterator[tuple[str, str]]:
    """Versions 1 and 2 of model 'ext-model', published whole from this process."""
    from mx_refit.testing.checkpoints import load_version

    from mx_refit import PublishedTensor, Publisher
    from mx_refit import start_catalog

    server = start_catalog()
    keep, publishers = [], []
    for version in (1, 2):
        tensors = load_version(ckpts[version])
        keep.append(tensors)
        pub = Publisher(server.address, "ext-model", source_id=f"ext-v{version}")
        pub.publish(version, [PublishedTensor(n, t) for n, t in tensors.items()])
        publishers.append(pub)
    yield server.address, "ext-model"
    for pub in publishers:
        pub.close()
    server.stop(0)


def upstream_config(catalog: str, model: str, **extra) -> dict:
    """An MX config as Dynamo's MX branch sends it, pointed at the mx-refit catalog."""
    return {
        "enabled": True,
        "mx_server_url": f"grpc://{catalog}",
        "model_name": model,
        "timeout_seconds": 60,
        "same_rank_only": False,
        "tree_scale_out": False,
        "moe_expert_filter": True,
        "buffer_loc": "host",
        **extra,
    }


def post(worker: DynamoWorkerProc, route: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"{worker.system_url}/engine/{route}", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def test_vllm_mixes_the_extension_in_alone_and_with_dynamos(ext_workers) -> None:
    (alone,) = ext_workers["alone"].ranks("stats")
    (fpm,) = ext_workers["fpm"].ranks("stats")
    assert "MxRefitWorkerExtension" in alone["mro"] and "FpmGcWorkerExtension" not in alone["mro"]
    assert {"WithFpmGc", "MxRefitWorkerExtension", "FpmGcWorkerExtension"} <= set(fpm["mro"])
    # Dynamo's own extension method stays reachable through the same route.
    worker = ext_workers["fpm"]
    assert post(worker, "pause_generation", {"mode": "keep"})["status"] == "ok"
    reply = post(worker, "update_weights_from_distributed", {"engine_rpc": "fpm_gc_maintain", "reset_prefix_cache": False})
    assert post(worker, "resume_generation", {})["status"] == "ok"
    assert reply["status"] == "ok", reply


@pytest.mark.parametrize("which", ["alone", "fpm"])
def test_update_weights_via_mx_through_engine_rpc(ext_workers, published, ckpts, which) -> None:
    catalog, model = published
    worker = ext_workers[which]
    worker.calls()
    client = DynamoRefitClient([worker.system_url])
    for version in (1, 2):
        client.refit_via_extension(version, mx_config=upstream_config(catalog, model))
        worker.check(ckpts[version])
        worker.current = ckpts[version]
    assert worker.calls()[-4:] == [
        "pause_generation", "rpc:update_weights_via_mx", "reset_prefix_cache", "resume_generation"
    ]
    (stats,) = worker.ranks("stats")
    assert stats["own_engine"] is (which == "alone")  # built its own only when the worker had none
    assert stats["last_update"]["version"] == 2 and stats["last_update"]["wait_s"] == 60
    assert client.weight_versions() == {worker.system_url: "2"}


@pytest.mark.parametrize(
    "mx_extra, version, expect",
    [
        ({}, 99, "'ext-model' has no version 99"),
        ({"nic_pin": "mlx5_0"}, 1, r"mx_config\.nic_pin='mlx5_0': refused"),
        ({"tree_scale_out": True}, 1, r"mx_config\.tree_scale_out=True"),
        ({"mx_sever_url": "x"}, 1, "did you mean 'mx_server_url'"),
    ],
)
def test_a_failure_becomes_a_route_error_and_keeps_the_weights(
    ext_workers, published, mx_extra, version, expect
) -> None:
    catalog, model = published
    worker = ext_workers["alone"]
    worker.calls()
    client = DynamoRefitClient([worker.system_url])
    with pytest.raises(DynamoRefitError, match=expect) as caught:
        client.refit_via_extension(version, mx_config=upstream_config(catalog, model, **mx_extra))
    assert caught.value.resumed == (worker.system_url,)
    assert worker.calls()[-1] == "resume_generation"
    worker.assert_untouched()
