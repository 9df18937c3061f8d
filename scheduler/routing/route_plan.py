"""The router's records (scheduler/routing/router.py): a prefill instance with its queued prefills
(:class:`PrefillInstance`, T_queue from :mod:`scheduler.policy.backlog`), a decode instance with the
requests it runs (:class:`DecodeInstance`) and an admitted request's plan (:class:`RoutePlan`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic

from engines.types import EngineInfo
from scheduler.policy.backlog import PrefillBacklog
from scheduler.policy.views import Decision, DecodeWork, PrefillView, TierHit
from scheduler.routing.engine_link import C


@dataclass
class PrefillInstance(Generic[C]):
    """A prefill engine and the requests routed to it whose prefill has not finished, with
    their predicted seconds (``backlog``; T_queue is ``backlog.queue_s(now)``,
    :mod:`scheduler.policy.backlog`)."""

    client: C
    info: EngineInfo
    backlog: PrefillBacklog = field(default_factory=PrefillBacklog)

    def queue_s(self, now_s: float) -> float:
        return self.backlog.queue_s(now_s)

    def view(self, engine_id: str, now_s: float, hit: TierHit) -> PrefillView:
        """The instance as a policy sees it at ``now_s``, ``hit`` its own prefix hit."""
        return PrefillView(engine_id, self.queue_s(now_s), len(self.backlog), hit, *self.backlog.tokens())


@dataclass
class DecodeInstance(Generic[C]):
    """A decode engine and the requests routed to it and not yet finished, with their
    predicted join and finish instants."""

    client: C
    info: EngineInfo
    work: dict[str, DecodeWork] = field(default_factory=dict)

    @property
    def running(self) -> int:
        """Sequences routed here and not finished (a request with ``n`` counts ``n``)."""
        return sum(w.sequences for w in self.work.values())


@dataclass(frozen=True)
class RoutePlan:
    """An admitted request: its identity, block keys, the pool's hit, and the policy's
    :class:`Decision` (instances, fetch, predicted TTFT and TBT). ``max_load_blocks``: the
    prefix the prefill engine may load from the pool (:func:`scheduler.policy.views.load_limit`:
    set when the policy chose to recompute what the pool holds; None: any hit). ``reuse``
    False: pool off for this request (planned as a full prefill; the engine recomputes it).
    ``sequences``: how many it decodes (OpenAI's ``n``); each counts in flight and in the
    decode batch."""

    request_id: str
    namespace: str
    prompt_tokens: int
    max_tokens: int
    keys: tuple[bytes, ...]
    pool_hit: TierHit
    decision: Decision
    max_load_blocks: int | None = None
    reuse: bool = True
    sequences: int = 1

    @property
    def predicted_ttft_s(self) -> float:
        return self.decision.ttft_s

    @property
    def prefill_id(self) -> str:
        return self.decision.prefill_id

    @property
    def decode_id(self) -> str:
        return self.decision.decode_id
