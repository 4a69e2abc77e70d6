"""The remote agents one NIXL agent has loaded, keyed by peer, for
:class:`~mx_refit.transport.nixl.NixlTransport`.

Measured NIXL behaviour (nixl 1.5.1 / UCX) this is shaped by:

* A source publishes its metadata through the catalog AFTER registering, and again whenever it
  registers more memory; :meth:`RemoteAgents.connect` reloads a peer whenever its metadata bytes
  change (restart or new registrations).
* ``add_remote_agent`` returns the name as ``bytes``; loading new metadata for an agent name that
  is already loaded fails with ``NIXL_ERR_NOT_ALLOWED`` (the old one must be removed first).
* Every failed ``add_remote_agent`` of a dead peer leaks a UCX socket that nothing can free (3 per
  source death when reads retried by reloading its metadata). So a peer that disconnected is
  removed at once (``remove_remote_agent`` frees its endpoints) and never reloaded inside a read,
  and an agent whose connection failed is not loaded again with the same metadata for
  ``unreachable_s``: a restarted source brings new metadata (and, from a Publisher, a new name).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from mx_refit.errors import InvalidArgument, TransferError
from mx_refit.transport.nixl_agent import as_str

__all__ = ["Peer", "RemoteAgents"]

log = logging.getLogger(__name__)

_UNREACHABLE_KEPT = 4096  # failed agents remembered at most (oldest forgotten first)


@dataclass
class Peer:
    agent_name: str
    metadata: bytes


class RemoteAgents:
    """Peer keys -> remote agents loaded from their metadata, plus the agents whose connection
    failed recently. Not thread-safe on its own: the owning transport calls every method under its
    agent lock."""

    def __init__(self, agent: Any, unreachable_s: float) -> None:
        self.agent: Any = agent  # set to None by the transport when it closes
        self.unreachable_s = unreachable_s
        self.peers: dict[str, Peer] = {}
        self.loaded: dict[str, bytes] = {}  # remote agent name -> metadata loaded for it
        # Agents whose connection failed -> (when, why, their metadata); bounded, oldest first.
        self._unreachable: dict[str, tuple[float, str, bytes]] = {}
        self.remote_loads = 0  # real add_remote_agent calls

    def connect(self, peer_key: str, agent_name: str, metadata: bytes) -> str:
        """Load the peer's agent metadata unless exactly these bytes are already loaded; changed
        metadata replaces the old remote agent. Returns the remote agent name."""
        peer = self.peers.get(peer_key)
        if (
            peer is not None
            and peer.agent_name == agent_name
            and peer.metadata == metadata
            and self.loaded.get(agent_name) == metadata
        ):
            return agent_name
        loaded = self.loaded.get(agent_name)
        if loaded is not None and loaded != metadata:
            # NIXL refuses to load new metadata over a loaded agent (NIXL_ERR_NOT_ALLOWED).
            self._unload(agent_name)
        if agent_name not in self.loaded:
            self._refuse_unreachable(peer_key, agent_name, metadata)
            self._load(peer_key, agent_name, metadata)
        if peer is not None and peer.agent_name != agent_name:
            self.peers.pop(peer_key)
            self._unload_if_unused(peer.agent_name)
        self.peers[peer_key] = Peer(agent_name, metadata)
        return agent_name

    def disconnect(self, peer_key: str) -> None:
        """Forget ``peer_key``; its remote agent is removed once no other peer key uses it."""
        peer = self.peers.pop(peer_key, None)
        if peer is not None:
            self._unload_if_unused(peer.agent_name)

    def drop_disconnected(self, agent_name: str) -> None:
        """The agent's endpoint failed: remove it now (frees its sockets and NIXL state) and refuse
        its current metadata for ``unreachable_s``. Its peer keys stay known."""
        metadata = self.loaded.get(agent_name)
        if metadata is not None:
            self._unload(agent_name)
            self._mark_unreachable(agent_name, "it disconnected", metadata)

    def unload_all(self) -> None:
        for agent_name in list(self.loaded):
            self._unload(agent_name)
        self.peers.clear()

    def _refuse_unreachable(self, peer_key: str, agent_name: str, metadata: bytes) -> None:
        failed = self._unreachable.get(agent_name)
        if failed is None:
            return
        when, why, dead_metadata = failed
        if metadata != dead_metadata or time.monotonic() - when >= self.unreachable_s:
            del self._unreachable[agent_name]
            return
        raise TransferError(
            f"peer {peer_key}: agent {agent_name} is unreachable ({why}); not reloading it for "
            f"{self.unreachable_s:g} s after the failure (a restarted source brings new metadata)",
            source_id=peer_key,
        )

    def _mark_unreachable(self, agent_name: str, why: str, metadata: bytes) -> None:
        self._unreachable.pop(agent_name, None)
        self._unreachable[agent_name] = (time.monotonic(), why, metadata)
        while len(self._unreachable) > _UNREACHABLE_KEPT:
            del self._unreachable[next(iter(self._unreachable))]

    def _load(self, peer_key: str, agent_name: str, metadata: bytes) -> None:
        try:
            loaded_name = as_str(self.agent.add_remote_agent(metadata))
        except Exception as exc:
            self._remove_remote(agent_name)  # whatever part of it NIXL kept
            self._mark_unreachable(agent_name, f"loading its metadata failed: {type(exc).__name__}", metadata)
            raise TransferError(
                f"peer {peer_key}: loading metadata of agent {agent_name} ({len(metadata)} bytes) "
                f"failed: {type(exc).__name__}: {exc}",
                source_id=peer_key,
            ) from exc
        self.remote_loads += 1
        if loaded_name != agent_name:
            self._remove_remote(loaded_name)
            raise InvalidArgument(
                f"peer {peer_key}: metadata belongs to agent {loaded_name!r}, not {agent_name!r}"
            )
        self.loaded[agent_name] = metadata

    def _unload(self, agent_name: str) -> None:
        self.loaded.pop(agent_name, None)
        self._remove_remote(agent_name)

    def _unload_if_unused(self, agent_name: str) -> None:
        if all(p.agent_name != agent_name for p in self.peers.values()):
            self._unload(agent_name)

    def _remove_remote(self, agent_name: str) -> None:
        try:
            self.agent.remove_remote_agent(agent_name)
        except Exception as exc:  # already gone / disconnected: nothing left to undo
            log.debug("remove_remote_agent(%s) failed: %s", agent_name, exc)
