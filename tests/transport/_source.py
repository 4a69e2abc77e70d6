"""A publishing process for the transport tests (run in a spawned child via ``runpy.run_path``).

It builds deterministic pattern tensors from a seed, registers them with a real
:class:`NixlTransport` in one call, and answers commands from the test over a multiprocessing
Pipe. The reader recomputes the same patterns with :func:`make_patterns` to check bytes.
Loaded by file path (not imported by module name) so it works under any pytest import mode.
"""

from __future__ import annotations

from typing import Any

BLOB_BYTES = 4 << 20  # 4 MiB of random bytes
MATRIX_SHAPE = (512, 384)  # float32, 1,536-byte rows
EXTRA_BYTES = 256 << 10


def make_patterns(seed: int) -> dict[str, Any]:
    """The tensors a source with ``seed`` publishes (identical in every process)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "blob": torch.randint(0, 256, (BLOB_BYTES,), dtype=torch.uint8, generator=g),
        "matrix": torch.randn(MATRIX_SHAPE, generator=g, dtype=torch.float32),
        "small": torch.arange(1000, dtype=torch.int64) * (seed + 1),
    }


def make_extra(seed: int) -> Any:
    """A tensor registered later (on the "add" command) to exercise metadata refresh."""
    import torch

    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randint(0, 256, (EXTRA_BYTES,), dtype=torch.uint8, generator=g)


def _describe(tensors: dict[str, Any]) -> dict[str, tuple[int, int]]:
    return {name: (t.data_ptr(), t.numel() * t.element_size()) for name, t in tensors.items()}


def serve(conn: Any, agent: str, seed: int, device: str = "cpu") -> None:
    import torch

    from mx_refit.transport.nixl import NixlTransport

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    transport = NixlTransport(agent)
    tensors = {name: t.to(device) for name, t in make_patterns(seed).items()}
    transport.register_many(list(tensors.values()))
    conn.send(
        {
            "agent": transport.agent_name,
            "metadata": transport.metadata(),
            "tensors": _describe(tensors),
            "registrations": transport.registrations,
        }
    )
    try:
        while True:
            cmd = conn.recv()
            if cmd == "exit":
                break
            if cmd == "add":
                tensors["extra"] = make_extra(seed)
                transport.register(tensors["extra"])
                conn.send({"metadata": transport.metadata(), "tensors": _describe(tensors),
                           "registrations": transport.registrations})
    except EOFError:  # the test process went away
        pass
    finally:
        transport.close()
        conn.close()


if __name__ == "__mx_transport_source__":
    serve(**SOURCE_ARGS)  # type: ignore[name-defined]  # noqa: F821 (injected by run_path)
