"""Case 6: ``/v1/rl/workers`` replies (Dynamo 1.6.1's protocol version 1) and system URLs."""

from __future__ import annotations

import pytest

from mx_refit.errors import InvalidArgument, Unavailable
from mx_refit_dynamo import DynamoRefitClient, DynamoWorker, fetch_workers, parse_workers
from mx_refit_dynamo.discovery import REQUIRED_ROUTES, rl_base_url

ROUTES = sorted([*REQUIRED_ROUTES, "liveness_probe", "flush_cache", "get_weight_version"])


def row(instance: int, url: str | None = "http://10.0.0.5:8081", **extra) -> dict:
    out = {
        "namespace": "dynamo", "component": "backend", "endpoint": "rl", "instance_id": instance,
        "transport": {"tcp": "10.0.0.5:4000"}, "request_plane_url": "tcp://10.0.0.5:4000",
        "model": "qwen3", "routes": ROUTES, "world_size": 2,
    }
    if url is not None:
        out["system_url"] = url
    out.update(extra)
    return out


def test_a_recorded_reply_yields_workers_in_order_with_world_sizes() -> None:
    reply = {
        "protocol_version": 1,
        "namespace": "dynamo",
        "workers": [
            row(1, "http://10.0.0.5:8081/"),
            row(2, "http://10.0.0.6:8081", world_size=4),
            row(3, None, component="prefill", error="timeout"),  # another component: skipped
        ],
    }
    workers = parse_workers(reply, component="backend")
    assert workers == [
        DynamoWorker("http://10.0.0.5:8081", 2, "dynamo.backend#1"),
        DynamoWorker("http://10.0.0.6:8081", 4, "dynamo.backend#2"),
    ]
    # A per-rank update list is split by those world sizes.
    client = DynamoRefitClient(workers)
    split = client._split([{"version": 3, "wait_s": float(i)} for i in range(6)])
    assert [len(v) for v in split.values()] == [2, 4]


@pytest.mark.parametrize(
    "bad_row, message",
    [
        (row(4, None, error="deadline exceeded"), "dynamo.backend#4: the frontend could not reach it: deadline exceeded"),
        (row(5, None), "dynamo.backend#5: no system_url"),
        (row(6, None, admin_base_url="http://x:9"), "dynamo.backend#6: a sidecar engine"),
        (row(7, routes=["liveness_probe"]), "dynamo.backend#7: lacks engine routes"),
        (row(8, "ftp://x:1"), "system_url: expected 'http://host:port'"),
        (row(9, world_size=0), "world_size: expected an integer >= 1"),
    ],
)
def test_an_unusable_worker_is_an_error_not_a_silent_skip(bad_row, message) -> None:
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(")):
        parse_workers({"workers": [row(1), bad_row]})


@pytest.mark.parametrize(
    "reply, message",
    [
        ({"workers": []}, "no worker"),
        ({"nope": 1}, "expected an object with a 'workers' list"),
        ({"protocol_version": 2, "workers": [row(1)]}, "protocol_version 2 is not supported"),
        ({"workers": [row(1, model="other")]}, "no worker with model='qwen3'"),
    ],
)
def test_malformed_or_empty_replies(reply, message) -> None:
    with pytest.raises(InvalidArgument, match=message):
        parse_workers(reply, model="qwen3")


def test_system_urls_are_validated_by_name() -> None:
    assert DynamoWorker.from_url("http://h:1/engine/").system_url == "http://h:1"
    for bad in ("h:1", "http://h:1/v1", "http://h:1?x=1"):
        with pytest.raises(InvalidArgument, match="system_url"):
            DynamoWorker.from_url(bad)
    with pytest.raises(InvalidArgument, match="duplicate system URLs"):
        DynamoRefitClient(["http://h:1", "http://h:1/"])
    with pytest.raises(InvalidArgument, match="pause_mode"):
        DynamoRefitClient(["http://h:1"], pause_mode="later")
    with pytest.raises(InvalidArgument, match="a per-rank list needs 2 entries"):
        DynamoRefitClient([DynamoWorker.from_url("http://h:1", world_size=2)])._split([{}])


def test_an_unreachable_worker_fails_by_name_within_its_timeout() -> None:
    from mx_refit_dynamo import DynamoRefitError

    client = DynamoRefitClient(["http://127.0.0.1:9"], init_timeout_s=5)
    with pytest.raises(DynamoRefitError, match=r"http://127.0.0.1:9: init_weights_update_group: .*unreachable"):
        client.init_weight_transfer_engine({"catalog": "127.0.0.1:1", "model": "m"})
    with pytest.raises(InvalidArgument, match="were never initialised"):
        client.start_weight_update()


def test_a_per_rank_list_is_refused_when_a_world_size_is_unknown() -> None:
    # A bare URL, or a discovery row without world_size, has no known rank count: splitting a
    # per-rank list by a guessed 1 would hand TP>1 workers the wrong ranks' entries.
    row_without_size = row(1)
    del row_without_size["world_size"]
    (discovered,) = parse_workers({"workers": [row_without_size]})
    assert discovered.world_size is None
    for workers in (["http://h:1"], [discovered], [DynamoWorker.from_url("http://h:2", world_size=2), "http://h:3"]):
        client = DynamoRefitClient(workers)
        with pytest.raises(InvalidArgument, match=r"update_info: a per-rank list needs each worker's world_size"):
            client._split([{"version": 1}] * 3)
        # One dict for every rank needs no world size.
        assert all(v == {"version": 1} for v in client._split({"version": 1}).values())


def test_the_frontend_url_defaults_to_the_rl_port() -> None:
    assert rl_base_url("http://frontend") == "http://frontend:8001"
    assert rl_base_url("http://frontend/v1/") == "http://frontend:8001"
    assert rl_base_url("https://frontend:9001/") == "https://frontend:9001"
    for bad in ("frontend:8001", "http://frontend:8001/v1/rl", "http://frontend:8001?x=1"):
        with pytest.raises(InvalidArgument, match="frontend_url: .*DYN_RL_PORT"):
            rl_base_url(bad)


def test_a_404_names_the_rl_port() -> None:
    # A real HTTP server that serves no /v1/rl/* (as Dynamo's OpenAI HTTP port does not).
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_error(404)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(Unavailable, match=r"HTTP 404 \(/v1/rl/\* is served only on the frontend's RL port, DYN_RL_PORT"):
            fetch_workers(url, timeout_s=10)
    finally:
        server.shutdown()
        server.server_close()
