"""The decision API's data: what a scheduling policy sees and what it answers.

Every policy (:class:`scheduler.policy.conductor.Conductor` and the baselines of
:mod:`scheduler.policy.baselines`) is a pure, synchronous function of these frozen views — no
asyncio, no gRPC, no clock: the caller passes ``now_s`` in. The async
:class:`scheduler.routing.router.Router` builds the views from live state (engine clients, the store
node's lookup, its replica of the engines' caches, wall-clock seconds); the simulator
(``scheduler/sim/``) builds them from virtual state and virtual seconds. Both then apply the
:class:`Decision` themselves (queue the request, fetch the prefix, record replication).

The views made per instance per request (:class:`TierHit`, :class:`PrefillView`,
:class:`DecodeWork`, :class:`DecodeView`) are NamedTuples — immutable, and several times
cheaper to build than frozen dataclasses; the rest are frozen dataclasses.

Units: seconds for times, tokens and blocks for sizes; ``now_s`` and every ``*_s`` instant
(``start_s``, ``finish_s``) are on the caller's clock, whatever its origin.

Shapes::

    RequestView(request_id, prompt_tokens, block_keys, max_tokens, block_size, sequences)
    ClusterView(now_s, prefill=(PrefillView, ...), decode=(DecodeView, ...), pool_hit=TierHit,
                inflight=int, colocated=bool)
    policy.decide(request, cluster) -> Decision | Rejection
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from scheduler.policy.admission import Rejection

__all__ = ["TierHit", "NO_HIT", "RequestView", "PrefillView", "DecodeWork", "DecodeView",
           "ClusterView", "FetchPlan", "Decision", "Rejection", "POOL", "load_limit"]

POOL = "pool"   # FetchPlan.source when the prefix comes from the KV pool (a store node)


class TierHit(NamedTuple):
    """A prefix hit of one request on one holder (an instance's own cache, or the pool).

    ``blocks``: length of the longest cached prefix (blocks, head first). ``by_tier``:
    ``(tier, blocks)`` pairs in chain order — the first ``by_tier[0][1]`` blocks sit in
    ``by_tier[0][0]``, and so on; the counts sum to ``blocks``. Tiers are ``"hbm"``,
    ``"dram"``, ``"ssd"`` (docs/architecture.md §3.3). Build one with :meth:`from_tiers`.
    """

    blocks: int = 0
    by_tier: tuple[tuple[str, int], ...] = ()

    @classmethod
    def from_tiers(cls, tiers: tuple[str, ...] | list[str]) -> TierHit:
        """From the tier of each block, head first (``PrefixMatch.per_node[n]``,
        ``LookupResult.tiers``): runs of one tier become one pair."""
        n = len(tiers)
        runs: list[tuple[str, int]] = []
        i = 0
        while i < n:
            tier = tiers[i]
            c = tiers[i:].count(tier)     # C-speed; one run when the first c are all `tier`
            if c > 1 and tiers[i:i + c].count(tier) != c:
                c = 1                     # not one run: walk it
                while i + c < n and tiers[i + c] == tier:
                    c += 1
            runs.append((tier, c))
            i += c
        return cls(n, tuple(runs))

    @classmethod
    def uniform(cls, blocks: int, tier: str) -> TierHit:
        """``blocks`` blocks all in ``tier``."""
        return cls(blocks, ((tier, blocks),) if blocks > 0 else ())

    def between(self, start: int, end: int) -> tuple[tuple[str, int], ...]:
        """``(tier, blocks)`` of the blocks ``[start, min(end, blocks))`` of the chain."""
        out, pos = [], 0
        for tier, n in self.by_tier:
            lo, hi = max(pos, start), min(pos + n, end)
            if hi > lo:
                out.append((tier, hi - lo))
            pos += n
        return tuple(out)


NO_HIT = TierHit()


@dataclass(frozen=True, slots=True)
class RequestView:
    """One request. ``prompt_tokens``: its length (tokens, >= 1); ``block_keys``: keys of its
    full blocks, head first (``prompt_tokens // block_size`` of them); ``max_tokens``: tokens
    it will generate at most (>= 1), per sequence; ``block_size``: tokens per block;
    ``sequences``: how many sequences it decodes from the one prompt (OpenAI's ``n``, >= 1):
    each takes a slot of the decode batch and its own ``max_tokens`` of KV, and each counts
    in flight."""

    request_id: str
    prompt_tokens: int
    block_keys: tuple[bytes, ...]
    max_tokens: int
    block_size: int = 16
    sequences: int = 1

    @property
    def kv_tokens(self) -> int:
        """KV tokens it holds in decode at most: the prompt once, ``max_tokens`` per sequence."""
        return self.prompt_tokens + self.sequences * self.max_tokens


class PrefillView(NamedTuple):
    """A prefill instance. ``queue_s``: T_queue (Algorithm 1; its one definition is
    :mod:`scheduler.policy.backlog`'s): the remaining predicted seconds of the prefill running
    there plus the predicted seconds of every request queued there; ``queued``: how many
    requests routed to it have not finished their prefill; ``hit``: its own cache's
    prefix hit for this request (usually all ``hbm``). The load as the routers of other
    projects count it (docs/routers.md): ``prefill_tokens``, the prompt tokens still to
    compute (uncached, as each decision planned) of the requests counted in ``queued``;
    ``prompt_tokens``, their prompts' tokens; ``kv_usage``, the fraction of the instance's
    KV cache its running requests hold (vLLM's ``kv_cache_usage``; 0 when unknown)."""

    instance_id: str
    queue_s: float = 0.0
    queued: int = 0
    hit: TierHit = NO_HIT
    prefill_tokens: int = 0
    prompt_tokens: int = 0
    kv_usage: float = 0.0


class DecodeWork(NamedTuple):
    """A request a decode instance holds or will hold: ``kv_tokens`` (prompt + tokens to
    generate, every sequence's), ``start_s`` (when it joins the decode batch: <= now for
    running requests, the predicted end of prefill for requests still in prefill),
    ``finish_s`` (predicted end), ``sequences`` (how many it decodes in the batch:
    OpenAI's ``n``)."""

    kv_tokens: int
    start_s: float
    finish_s: float
    sequences: int = 1


def decoding_finish(now: float, max_tokens: int, tokens: int, mean_tbt_s: float) -> float:
    """When a request decoding since its first token ends, predicted from its progress:
    ``max_tokens - tokens`` more tokens (``tokens``: those it has produced, the first,
    from prefill, included), each ``mean_tbt_s`` seconds after the last (its mean gap so
    far), from ``now``. The live router re-times a streaming request's decode work with
    it (:meth:`scheduler.routing.router.Router.decode_progress`), the simulator its running
    requests'."""
    return now + max(0, max_tokens - tokens) * mean_tbt_s


OVERDUE_S = 1e-3   # a request held past its predicted finish is shown ending this long after now


def held_work(work: DecodeWork, now: float) -> DecodeWork:
    """``work`` as a decode view shows it at ``now``: a request the instance still holds
    past its predicted finish (it decodes slower than predicted, or its prefill ran long)
    is still there, so it is shown ending :data:`OVERDUE_S` after ``now`` — counted in the
    load at ``now``, gone for a request arriving later — not vanished from the load while
    it holds its slot. The live router and the simulator build their views through this."""
    if work.finish_s > now:
        return work
    return work._replace(finish_s=now + OVERDUE_S, start_s=min(work.start_s, now))


class DecodeView(NamedTuple):
    """A decode instance: its ``work`` (running and incoming requests), and its limits:
    ``max_running`` (batch size) and ``kv_capacity_tokens`` (KV it can hold)."""

    instance_id: str
    work: tuple[DecodeWork, ...] = ()
    max_running: int = 64
    kv_capacity_tokens: int = 1 << 20


@dataclass(frozen=True, slots=True)
class ClusterView:
    """Everything a policy looks at for one request. ``pool_hit``: the KV pool's prefix hit
    (by tier) for the request; ``inflight``: requests admitted and not finished (for the
    ``max_inflight`` bound). ``prefill`` and ``decode`` are non-empty, in a stable order.
    ``colocated``: every instance prefills and decodes (``decode`` lists them by the same
    ids): a request decodes where it prefilled, so the decode instance is the chosen
    prefill instance and admission judges that one."""

    now_s: float
    prefill: tuple[PrefillView, ...]
    decode: tuple[DecodeView, ...]
    pool_hit: TierHit = NO_HIT
    inflight: int = 0
    colocated: bool = False

    def __str__(self) -> str:
        """One line for a log: per prefill instance its T_queue, queued requests and hit
        blocks; per decode instance its KV capacity and the requests and KV tokens of its work
        (those decoding now, then those still to join)."""
        now = self.now_s
        pre = ", ".join(f"{v.instance_id} queue {v.queue_s:.2f} s, {v.queued} queued, hit {v.hit.blocks}"
                        for v in self.prefill)

        def work(d: DecodeView, joined: bool) -> str:
            ws = [w for w in d.work if (w.start_s <= now) == joined]
            return f"{len(ws)} {'decoding' if joined else 'to join'} ({sum(w.kv_tokens for w in ws)} tokens)"
        dec = ", ".join(f"{d.instance_id} KV {d.kv_capacity_tokens}: {work(d, True)}, {work(d, False)}"
                        for d in self.decode)
        return f"prefill [{pre}]; decode [{dec}]; pool hit {self.pool_hit.blocks}"


@dataclass(frozen=True, slots=True)
class FetchPlan:
    """Load the prompt's blocks ``[first_block, first_block + blocks)`` from ``source`` (a
    prefill instance id, or :data:`POOL`) into the chosen prefill instance before computing;
    ``transfer_s``: predicted seconds. The receiving instance keeps the blocks (hot prefixes
    replicate by themselves)."""

    source: str
    first_block: int
    blocks: int
    transfer_s: float


@dataclass(frozen=True, slots=True)
class Decision:
    """An admitted request's placement and predictions.

    ``prefill_id``/``decode_id``: chosen instances; ``cached_tokens``: prompt tokens reused
    (local hit + fetched, never the last token); ``fetch``: what to fetch first (None: local
    hit only); ``queue_s + transfer_s + prefill_s == ttft_s`` (predicted; ``transfer_s``
    covers reading the instance's own non-``hbm`` blocks plus ``fetch``); ``tbt_s``:
    predicted time between tokens on ``decode_id`` when it gets there; ``decode_start_s`` /
    ``decode_finish_s``: predicted instants (caller's clock) it joins and leaves decode;
    ``decode_running``: sequences predicted on ``decode_id`` at ``decode_start_s`` (this
    request's included); ``prompt_tokens``: the request's length.
    """

    policy: str
    request_id: str
    prefill_id: str
    decode_id: str
    cached_tokens: int
    fetch: FetchPlan | None
    queue_s: float
    transfer_s: float
    prefill_s: float
    ttft_s: float
    tbt_s: float
    decode_start_s: float
    decode_finish_s: float
    decode_running: int = 0
    prompt_tokens: int = 0

    @property
    def compute_tokens(self) -> int:
        """Prompt tokens the prefill instance computes (prompt − cached)."""
        return self.prompt_tokens - self.cached_tokens


def load_limit(decision: Decision, pool_hit: TierHit, block_size: int) -> int | None:
    """The ``max_load_blocks`` to hand the prefill engine for ``decision``: the prefix
    (blocks, head first) it planned to reuse, when the pool held more than that at decision
    time — the policy chose to recompute the rest rather than fetch it — else None (take
    whatever the pool holds by then; blocks published after the decision are free gains).
    The engine's own cache is never limited."""
    planned = -(-decision.cached_tokens // block_size)
    return planned if pool_hit.blocks > planned else None
