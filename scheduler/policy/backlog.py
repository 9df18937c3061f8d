"""T_queue: the one definition of a prefill instance's queueing delay, shared by the live
router (:mod:`scheduler.routing.router`) and the simulator (:mod:`scheduler.sim`).

Mooncake (FAST'25 §4, Algorithm 1) estimates TTFT on instance ``i`` as ``T_queue_i +
T_transfer + T_prefill``, where ``T_queue_i`` is how long a request routed to ``i`` now waits
before its own prefill starts. An instance prefills one request at a time, in arrival order,
so that wait is::

    T_queue(now) = max(0, predicted_end(running) − now) + Σ predicted_s(queued)

— the *remaining* predicted seconds of the prefill that is running plus the full predicted
seconds of those that have not started. The other reading (the full predicted time of every
request not yet finished, the live router's until now) counts the seconds the running one
has already spent again: a 10-s prefill that is 9 s in still adds 10 s, so a busy instance
looks busier the longer its current prefill has run, and long prompts are steered away from
it for no reason. The simulator used the remaining-time reading; both use this class now.

The live router does not see when an engine starts a request (the engine queues RPCs
itself, first come first served), so it calls :meth:`PrefillBacklog.advance` after each
change: when nothing is running, the oldest queued request starts now. The simulator calls
:meth:`start` when its engine really starts one (a colocated instance starts at a decode-step
boundary).
"""
from __future__ import annotations

from collections import OrderedDict


class PrefillBacklog:
    """The requests routed to one prefill instance whose prefill has not finished, with
    their predicted prefill seconds. Invariant: ``running`` is at most one request (or
    several, when a caller starts more — they then overlap and each is counted by its own
    remaining time); a request is in at most one of ``queued`` and ``running``."""

    __slots__ = ("_queued", "_queued_s", "_running", "_tokens", "_compute", "_prompt")

    def __init__(self) -> None:
        self._queued: OrderedDict[str, float] = OrderedDict()   # id → predicted seconds
        self._queued_s = 0.0
        self._running: dict[str, tuple[float, float]] = {}      # id → (predicted end, predicted s)
        self._tokens: dict[str, tuple[int, int]] = {}           # id → (compute tokens, prompt tokens)
        self._compute = self._prompt = 0

    def __len__(self) -> int:
        return len(self._queued) + len(self._running)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._queued or request_id in self._running

    def add(self, request_id: str, predicted_s: float, compute_tokens: int = 0, prompt_tokens: int = 0) -> None:
        """Queue a request routed here with its predicted prefill seconds (>= 0), the prompt
        tokens its prefill computes and its prompt's tokens (for :meth:`tokens`)."""
        self.remove(request_id)
        self._queued[request_id] = max(0.0, predicted_s)
        self._queued_s += self._queued[request_id]
        self._tokens[request_id] = (compute_tokens, prompt_tokens)
        self._compute += compute_tokens
        self._prompt += prompt_tokens

    def tokens(self) -> tuple[int, int]:
        """(prompt tokens to compute, prompt tokens) of the requests queued and running."""
        return self._compute, self._prompt

    def start(self, request_id: str, now_s: float) -> None:
        """Its prefill starts at ``now_s`` (no-op for an unknown request)."""
        s = self._queued.pop(request_id, None)
        if s is None:
            return
        self._queued_s -= s
        self._running[request_id] = (now_s + s, s)

    def advance(self, now_s: float) -> str | None:
        """First come first served: when nothing is running, start the oldest queued request
        at ``now_s``. Returns its id (None when nothing started)."""
        if self._running or not self._queued:
            return None
        request_id = next(iter(self._queued))
        self.start(request_id, now_s)
        return request_id

    def predicted_end(self, request_id: str) -> float | None:
        """When the running prefill ``request_id`` is predicted to end (the caller's clock;
        None when it is not running)."""
        run = self._running.get(request_id)
        return None if run is None else run[0]

    def started_s(self, request_id: str) -> float | None:
        """When the running prefill ``request_id`` started (the caller's clock; None when it is
        not running)."""
        run = self._running.get(request_id)
        return None if run is None else run[0] - run[1]

    def remove(self, request_id: str) -> float | None:
        """It finished, failed or moved elsewhere: forget it. Returns its predicted seconds
        (None when unknown)."""
        c, p = self._tokens.pop(request_id, (0, 0))
        self._compute -= c
        self._prompt -= p
        s = self._queued.pop(request_id, None)
        if s is not None:
            self._queued_s -= s
            if not self._queued:
                self._queued_s = 0.0     # no float residue
            return s
        run = self._running.pop(request_id, None)
        return None if run is None else run[1]

    def queue_s(self, now_s: float) -> float:
        """T_queue at ``now_s`` (seconds, >= 0; the module docstring's formula)."""
        ahead = 0.0
        for end, _ in self._running.values():
            if end > now_s:
                ahead += end - now_s
        return ahead + max(0.0, self._queued_s)
