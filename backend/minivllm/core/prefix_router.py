"""Which engine replica a request goes to: the one most likely to hold its prompt's prefix.

A prompt's full blocks hash exactly as the scheduler hashes them (`hash_block_tokens`, chained from
the `cache_salt` root), so a hash the router saw sent to a replica names a block that replica has
cached unless it evicted it since. The router keeps, per replica, the hashes it sent there (a
bounded LRU: the replica's own pool is bounded too), picks the replica with the longest run of
matching leading blocks, and falls back to the least loaded replica when none matches.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from minivllm.core.block_manager import hash_block_tokens, hash_salt

ROUTING_POLICIES = ("prefix", "round_robin")


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    """The chained hashes of the prompt's full blocks, as `Sequence.block_hashes` computes them."""
    hashes: list[int] = []
    parent = None if salt is None else hash_salt(salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tuple(token_ids[start : start + block_size]))
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class RoutingDecision:
    request_id: str
    replica: int
    matched_blocks: int  # leading prompt blocks the chosen replica was sent before
    prompt_blocks: int
    reason: str  # "prefix" | "least_loaded" | "round_robin"


@dataclass
class ReplicaRoutes:
    """What the router knows of one replica."""

    blocks: OrderedDict[int, None]
    routed: int = 0
    matched_blocks: int = 0  # summed over the requests routed here
    prompt_blocks: int = 0
    alive: bool = True

    @property
    def hit_rate(self) -> float:
        return self.matched_blocks / self.prompt_blocks if self.prompt_blocks else 0.0


class PrefixRouter:
    def __init__(self, num_replicas: int, max_blocks: int = 65536, policy: str = "prefix", history: int = 50):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(ROUTING_POLICIES)}, got {policy!r}")
        self.max_blocks = max_blocks
        self.policy = policy
        self.replicas = [ReplicaRoutes(OrderedDict()) for _ in range(num_replicas)]
        self.decisions: deque[RoutingDecision] = deque(maxlen=history)
        self._next = 0  # round robin's turn

    def route(self, request_id: str, hashes: Sequence[int], loads: Sequence[int]) -> RoutingDecision:
        """Choose a live replica for a prompt with these block hashes; `loads`: each replica's
        running + waiting requests. Records the decision and the hashes as now held there."""
        live = [i for i, r in enumerate(self.replicas) if r.alive]
        if not live:
            raise RuntimeError("no live replica to route to")
        if self.policy == "round_robin":
            replica, reason = self._round_robin(live), "round_robin"
        else:
            replica, reason = self._by_prefix(live, hashes, loads)
        decision = RoutingDecision(request_id, replica, self.matched(replica, hashes), len(hashes), reason)
        self._record(decision, hashes)
        return decision

    def matched(self, replica: int, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` the router sent to `replica` (a chain: stop at the first miss)."""
        held = self.replicas[replica].blocks
        return next((i for i, h in enumerate(hashes) if h not in held), len(hashes))

    def mark_dead(self, replica: int) -> None:
        routes = self.replicas[replica]
        routes.alive = False
        routes.blocks.clear()

    def _by_prefix(self, live: list[int], hashes: Sequence[int], loads: Sequence[int]) -> tuple[int, str]:
        best = max(live, key=lambda i: (self.matched(i, hashes), -loads[i]))
        if self.matched(best, hashes) > 0:
            return best, "prefix"
        # ties on load go to the replica holding the fewest blocks, so distinct prefixes spread out
        # over the replicas' pools instead of crowding one
        return min(live, key=lambda i: (loads[i], len(self.replicas[i].blocks), i)), "least_loaded"

    def _round_robin(self, live: list[int]) -> int:
        replica = next((i for i in live if i >= self._next), live[0])
        self._next = replica + 1
        return replica

    def _record(self, decision: RoutingDecision, hashes: Sequence[int]) -> None:
        routes = self.replicas[decision.replica]
        routes.routed += 1
        routes.matched_blocks += decision.matched_blocks
        routes.prompt_blocks += decision.prompt_blocks
        for h in hashes:
            routes.blocks[h] = None
            routes.blocks.move_to_end(h)
        while len(routes.blocks) > self.max_blocks:
            routes.blocks.popitem(last=False)
        self.decisions.append(decision)
