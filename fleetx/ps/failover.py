"""The worker's side of server failover (``PSConfig.failover``, ``fleetrun --max_restarts``).

When a worker loses its link to a server, it does not fail the job: the requests pending on
that server stay pending (each kept with its message), new ones wait beside them, and a
thread reconnects, retrying until ``PSConfig.timeout`` (``FLEETX_TIMEOUT``) runs out, while
fleetrun restarts the server. Once the restarted server (which loaded its latest snapshot,
:mod:`fleetx.ps.snapshots`) answers HELLO, every unanswered request is sent again on the new
link, oldest first, and the worker logs how long the server was away and how many of its
pushes the server had applied after its snapshot: those updates are lost. A server that does
not come back in time, or refuses the worker, fails every pending request with a
:class:`~fleetx.ps.api.PeerLostError` naming it, as without failover.

A request sent again is applied once by the restarted server: the one that died took what it
had applied after its snapshot with it.

Example:
    >>> failover = Failover(client)                     # doctest: +SKIP
    >>> failover.send(0, msg)      # or keeps it for after the reconnection
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from fleetx.ps.api import (AuthError, Kind, Message, PeerLostError, PSError, PSTimeoutError,
                           endpoint_of)
from fleetx.ps.tracker import Handle
from fleetx.ps.transport import Link

__all__ = ["Failover"]

log = logging.getLogger("fleetx.ps")

_RETRY_S = 0.2


class Failover:
    """Reconnection to lost servers for one :class:`~fleetx.ps.client.KVClient`.

    Args:
        client: the client (its links, tracker, heartbeats and HELLO metadata are used).
    """

    def __init__(self, client: Any) -> None:
        n = client.config.num_servers
        self.client = client
        # reentrant: a send that fails reports the loss (Link._lose -> lost) on the thread
        # that holds the server's lock to send
        self._locks = [threading.RLock() for _ in range(n)]
        self._down = [False] * n
        self.acked = [0] * n  # pushes each server answered (it applied them)
        self.stopping = False

    def send(self, s: int, msg: Message) -> None:
        """Send ``msg`` to server ``s``, unless it is down: then it goes after the reconnection
        (the tracker keeps it). A send that fails is sent again the same way."""
        with self._locks[s]:
            if self._down[s]:
                return
            try:
                self.client._links[s].send(msg)
            except PeerLostError:
                pass  # the link reported its loss: the reconnection sends it again

    def replied(self, s: int, msg: Message) -> None:
        if msg.kind == Kind.PUSH and not msg.is_error:
            self.acked[s] += 1

    def lost(self, link: Link, reason: str) -> bool:
        """A link ended: start reconnecting (True), or let the client fail it (False: the
        client is stopping)."""
        s = link.peer_info["index"]
        with self._locks[s]:
            if link is not self.client._links[s]:
                return True  # an attempt that never became the server's link
            if self.stopping:
                return False
            if self._down[s]:
                return True
            self._down[s] = True
        threading.Thread(target=self._reconnect, args=(s, link, reason), daemon=True,
                         name=f"ps-reconnect {s}").start()
        return True

    def _reconnect(self, s: int, old: Link, reason: str) -> None:
        c, name = self.client.config, old.name
        began = time.monotonic()
        deadline = began + c.timeout
        self.client._heartbeats.discard(old)
        log.warning("worker %d: lost %s (%s); failover: reconnecting, for up to %.0f s "
                    "(FLEETX_TIMEOUT)", self.client.rank, name, reason, c.timeout)
        while True:
            try:
                link, meta = self._hello(s, name, deadline)
                break
            except (PSTimeoutError, PeerLostError) as e:
                if time.monotonic() >= deadline:
                    return self._give_up(s, name, f"{reason}; failover: not back within "
                                                  f"{c.timeout:.0f} s (FLEETX_TIMEOUT): {e}")
                time.sleep(_RETRY_S)
            except (AuthError, PSError) as e:  # refused: retrying cannot help
                return self._give_up(s, name, f"{reason}; failover: the restarted server "
                                              f"refused this worker: {e}")
        with self._locks[s]:
            self.client._retire(self.client._links[s])
            self.client._links[s] = link
            self.client._heartbeats.add(link)
            again = self.client._tracker.unanswered(s)
            self._report(s, name, meta, time.monotonic() - began, len(again))
            self._down[s] = False  # before the resends: a loss during them reconnects again
            for msg in again:
                try:
                    link.send(msg)
                except PeerLostError:
                    break  # lost again: lost() started another reconnection

    def _hello(self, s: int, name: str, deadline: float) -> tuple[Link, dict]:
        c, client = self.client.config, self.client
        host, port = endpoint_of(c.servers, s)
        link = client._connect(host, port, name, client._key,
                               timeout=max(0.1, deadline - time.monotonic()))
        link.peer_info["index"] = s
        link.start()
        handle = Handle(1)
        req = client._tracker.register(handle, 0, s)
        try:
            link.send(Message(Kind.HELLO, req, client._hello_meta()))
            reply = handle.wait(min(c.dead_after, max(0.1, deadline - time.monotonic())))
        except PSError as e:
            client._tracker.forget(req, e)
            link.close()
            raise
        return link, reply[0].meta

    def _report(self, s: int, name: str, meta: dict, away: float, again: int) -> None:
        if meta.get("rejoined"):  # the same server: only the connection broke
            log.warning("worker %d: %s is back after %.1f s: it kept running and kept its "
                        "tables, only the connection broke; %d unanswered request(s) sent "
                        "again", self.client.rank, name, away, again)
            return
        restored = meta.get("restored")
        kept = int(restored["pushes"]) if restored else 0
        lost, self.acked[s] = max(0, self.acked[s] - kept), kept
        where = (f"its snapshot {restored['save_id']} (written {restored['created']})"
                 if restored else "no snapshot (it started afresh)")
        log.warning("worker %d: %s is back after %.1f s (restart %s) with %s: %d push(es) of "
                    "this worker it had applied after that are lost; %d unanswered request(s) "
                    "sent again", self.client.rank, name, away, meta.get("restart", "?"), where,
                    lost, again)

    def _give_up(self, s: int, name: str, why: str) -> None:
        err = PeerLostError(name, why)
        self.client._lost = self.client._lost or err
        self.client._tracker.fail_peer(s, err)
