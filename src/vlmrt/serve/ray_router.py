"""The Model deployment's request router under `vlmrt serve --ray` (docs/server.md "Routing"): a follow-up goes to the
replica that was sent its conversation's earlier turns, a new conversation by load.

A conversation is known by the chained digests of its messages (conversation_digests: digest i covers messages 0..i
of the slot affinity key serve/request.py computes, images by the digest of their URL), so a request's digests are
its earlier turns' digests and one more per message. The router keeps a bounded map, digest of a routed request's
whole key -> the replica it was routed to, written the moment a replica takes the request (on_request_routed, which
Serve calls once the replica accepted it: before the handle returns the request's stream to the Ingress, so before
any answer can reach the client and its next turn be sent; Serve checks acceptance wherever a handle runs inside the
cluster, as the Ingress replica's does). A request looks up its own digests, the longest first: the replica found, while it lives, gets the request
unless its queue is longer than the shortest by more than `slack` (a replica's --slots); otherwise, and for a new
conversation, the power of two choices (two replicas at random, the one with the shorter queue). Entries of a replica
that leaves the candidate set (dies, scales down) are dropped; past `size` entries the least recently used goes.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

CONVERSATIONS = 16384  # map entries kept (LRU): one per routed turn; far above any deployment's replicas x slots


def conversation_digests(key: list) -> tuple[str, ...]:
    """The chained digests of a slot affinity key [(role, parts), ...]: the i-th covers messages 0..i."""
    out, h = [], b""
    for role, parts in key:
        h = hashlib.sha256(h + json.dumps([role, parts]).encode()).digest()[:16]
        out.append(h.hex())
    return tuple(out)


def digests_of(pending_request: PendingRequest | None) -> tuple[str, ...]:
    """The request's conversation digests: its argument's (ray_app.Ask, Model.generate's); none for Model.info."""
    if pending_request is None or not pending_request.args:
        return ()
    return pending_request.args[0].conversation


class ConversationRouter(RequestRouter):
    """Follow-ups to the replica holding their conversation (an exact map, not Ray's best-effort prefix tree), new
    conversations by the power of two choices. One router per DeploymentHandle: the Ingress's (one replica)."""

    def initialize_state(self, slack: int = 0, size: int = CONVERSATIONS):
        self.slack, self.size = slack, size
        self.held: OrderedDict[str, ReplicaID] = OrderedDict()  # conversation digest -> replica

    def holder(self, digests: tuple[str, ...], candidates: dict[ReplicaID, RunningReplica]) -> ReplicaID | None:
        for d in reversed(digests):  # the longest known prefix: the latest turn routed
            rid = self.held.get(d)
            if rid is not None and rid in candidates:
                self.held.move_to_end(d)
                return rid
        return None

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        candidates = {r.replica_id: r for r in candidate_replicas}
        rid = self.holder(digests_of(pending_request), candidates)
        if rid is not None:
            queue = {r: self.replica_queue_len_cache.get(r) or 0 for r in candidates}
            if queue[rid] - min(queue.values()) <= self.slack:
                return [[candidates[rid]]]
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        digests = digests_of(pending_request)
        if digests:
            self.held[digests[-1]] = replica_id
            self.held.move_to_end(digests[-1])
            while len(self.held) > self.size:
                self.held.popitem(last=False)

    def update_replicas(self, replicas: list[RunningReplica]):
        super().update_replicas(replicas)
        self._forget(set(self.curr_replicas))

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self._forget(set(self.curr_replicas))

    def _forget(self, live: set[ReplicaID]) -> None:
        """Drop the entries of replicas gone (a dead replica's conversations go by load from now on)."""
        for d in [d for d, rid in self.held.items() if rid not in live]:
            del self.held[d]
