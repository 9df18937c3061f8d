"""A simulated serving instance: a prefill queue and a continuous-batching decode batch whose
progress is advanced analytically, one event per batch change rather than one per token.

Decode timeline. Steps are numbered per instance; ``(k, t, dt)`` anchors it: step ``k`` ended
at ``t`` and each later step takes ``dt`` seconds. The batch only changes at step boundaries
(a request joins at a boundary and leaves at the boundary of its last token), and ``dt`` is
recomputed from the cost model at each change. Every change appends a *segment*
``(step, time, dt, gap)``: steps after ``step`` end at ``time + (x − step)·dt``, and the
first of them lasted ``gap`` (longer than ``dt`` when a prefill paused the batch in a
colocated instance). A request's token intervals are read back from the segments as
``(interval, count)`` runs when it finishes — what Mooncake's TBT needs, without per-token
records.
"""
from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections import deque

from engines.cost_model import NO_VARIANCE, CostModel, CostModelEngine, Variance
from scheduler.policy.backlog import PrefillBacklog
from scheduler.policy.views import DecodeView, DecodeWork, PrefillView, TierHit, decoding_finish, held_work
from scheduler.sim.workload import SimRequest

_EPS = 1e-9


class Instance:
    """One instance. ``prefill``/``decode``: the roles it plays (both when colocated).

    Invariants: ``running`` holds the requests of the batch, ``heap`` their finish steps;
    ``sum_prompt``/``sum_join`` are the sums of their prompt lengths and join steps, so the
    resident KV at step ``s`` is ``sum_prompt + len(running)·s − sum_join`` tokens."""

    def __init__(self, name: str, cost: CostModel, *, prefill: bool, decode: bool,
                 kv_capacity_tokens: int, max_running: int, block_size: int = 512,
                 variance: Variance = NO_VARIANCE) -> None:
        self.name = name
        self.cost = cost
        self.is_prefill, self.is_decode = prefill, decode
        role = "colocated" if prefill and decode else ("prefill" if prefill else "decode")
        self.engine = CostModelEngine(cost, name, role, block_size, variance)   # the instance's GPUs
        self.kv_capacity_tokens = kv_capacity_tokens
        self.kv_room = kv_capacity_tokens if decode else cost.kv_capacity_tokens()   # for kv_usage
        self.max_running = max_running
        # prefill side
        self.queue: deque[SimRequest] = deque()
        self.backlog = PrefillBacklog()  # T_queue (the live router's definition)
        self.prefilling: SimRequest | None = None
        self.prefill_busy_s = 0.0
        # decode side
        self.running: dict[int, SimRequest] = {}
        self.heap: list[tuple[int, int]] = []
        self.joiners: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()
        # rid → (kv tokens, start, finish) as the router books it: the decision's prediction,
        # re-timed as its prefill starts and ends; kept while it runs here, as live (its true
        # finish, on the heap, is never shown to the policy)
        self.incoming: dict[int, tuple[int, float, float]] = {}
        self.view_expires = math.inf     # the first booked finish: then an overdue one is shown anew
        self.view_step = -1              # the decode step the view was built at
        self.sum_prompt = 0
        self.sum_join = 0
        self.k, self.t, self.dt = 0, 0.0, 0.0
        self.paused = False
        self.chunks_left = 0             # chunked prefill: steps left of the running prefill
        self.chunk_s = 0.0               # ... and the prefill seconds each of them adds
        self.seg_step: list[int] = [0]
        self.seg_time: list[float] = [0.0]
        self.seg_dt: list[float] = [0.0]
        self.seg_gap: list[float] = [0.0]
        self.version = 0
        self.sched_s = math.inf
        self.view_dirty = True
        self.view: DecodeView | None = None

    # -- prefill ---------------------------------------------------------------------------
    def queue_s(self, now: float) -> float:
        """Predicted seconds of prefill work ahead of a new request (T_queue,
        :mod:`scheduler.policy.backlog`)."""
        return self.backlog.queue_s(now)

    def queued(self) -> int:
        return len(self.queue) + (self.prefilling is not None)

    def prefill_view(self, now: float, hit: TierHit) -> PrefillView:
        """The prefill instance as a policy sees it, with ``hit`` its own prefix hit; its KV
        usage, as vLLM reports it, is the KV of the prefill running there (and, colocated, of
        its decode batch) over its KV room (cached blocks no request holds count as free)."""
        compute, prompt = self.backlog.tokens()
        held = self.prefilling.prompt if self.prefilling is not None else 0
        room = self.kv_room
        if self.is_decode and self.running:
            held += self.kv_tokens(self.step_at(now))
        return PrefillView(self.name, self.queue_s(now), self.queued(), hit, compute, prompt,
                           min(1.0, held / room) if room > 0 else 0.0)

    def decode_view(self, now: float) -> DecodeView:
        """The decode instance as the live router sees it: each request routed there at the
        span its decision predicted, re-timed as its prefill started and ended; a running one,
        from its second token on, at its tokens still to come at its mean pace since its
        first (:func:`scheduler.policy.views.decoding_finish`, what ``Router.decode_progress``
        does with the tokens it streams); one held past its finish shown as just ending
        (:func:`scheduler.policy.views.held_work`). Never the engine's own finish step or the noise
        of the segments to come. Rebuilt when the batch changes or steps on."""
        step = self.step_at(now) if self.running else -1
        if self.view_dirty or self.view is None or now >= self.view_expires or step != self.view_step:
            booked = self.incoming
            if self.running:
                booked = dict(booked)
                time_of = self.time_of
                for rid, req in self.running.items():
                    last = min(step, req.join_step + req.output - 1)
                    done = last - req.join_step          # decode tokens streamed (the first came from prefill)
                    if done >= 1:
                        at = time_of(last)
                        kv, start, _ = booked[rid]
                        booked[rid] = (kv, start, decoding_finish(at, req.output, 1 + done,
                                                                  (at - req.first_token_s) / done))
            work = tuple(held_work(DecodeWork(kv, s, f), now) for kv, s, f in booked.values())
            self.view = DecodeView(self.name, work, self.max_running, self.kv_capacity_tokens)
            self.view_expires = min((w.finish_s for w in work), default=math.inf)
            self.view_step = step
            self.view_dirty = False
        return self.view

    # -- decode timeline -------------------------------------------------------------------
    def step_at(self, now: float) -> int:
        """The last step boundary at or before ``now``."""
        if self.paused or self.dt <= 0:
            return self.k
        return self.k + int((now - self.t) / self.dt + 1e-6)

    def next_boundary(self, now: float) -> float:
        """The first step boundary at or after ``now`` (``now`` when the batch is idle,
        infinity while a prefill pauses it)."""
        if self.paused:
            return math.inf
        if self.dt <= 0:
            return now
        steps = math.ceil((now - self.t) / self.dt - 1e-6)
        return self.t + max(0, steps) * self.dt

    def kv_tokens(self, step: int | None = None) -> int:
        s = self.k if step is None else step
        return self.sum_prompt + len(self.running) * s - self.sum_join

    def time_of(self, step: int) -> float:
        """When ``step`` ended (steps after the instance's last anchor are extrapolated)."""
        i = bisect_right(self.seg_step, step - 1) - 1
        return self.seg_time[i] + (step - self.seg_step[i]) * self.seg_dt[i]

    def finish_time(self, finish_step: int) -> float:
        return self.t + (finish_step - self.k) * self.dt

    def pop_finished(self, step: int) -> list[SimRequest]:
        """Remove the requests whose last token is at or before ``step``."""
        out = []
        heap, running = self.heap, self.running
        while heap and heap[0][0] <= step:
            f, rid = heapq.heappop(heap)
            req = running.pop(rid)
            self.incoming.pop(rid, None)
            self.sum_prompt -= req.prompt
            self.sum_join -= req.join_step
            req.finish_s = self.finish_time(f)
            req.tbt_runs = self.runs(req, f)
            out.append(req)
        if out:
            self.view_dirty = True
            self.engine.leave(len(out))
        return out

    def join(self, req: SimRequest, step: int, now: float) -> bool:
        """Put ``req`` in the batch at boundary ``step``; False (and nothing done) when it
        has a single token, which needs no decode step."""
        req.join_step = step
        self.view_dirty = True
        if req.output <= 1:
            self.incoming.pop(req.rid, None)
            req.finish_s = now
            return False
        self.running[req.rid] = req
        self.engine.join()
        self.sum_prompt += req.prompt
        self.sum_join += step
        heapq.heappush(self.heap, (step + req.output - 1, req.rid))
        return True

    def fits(self, req: SimRequest, extra: int = 0) -> bool:
        """Whether the batch has room (batch size and KV) for ``req`` now."""
        kv = self.kv_tokens() + extra + req.prompt + req.output
        return len(self.running) + 1 <= self.max_running and kv <= self.kv_capacity_tokens

    def reanchor(self, now: float, step: int, extra_s: float = 0.0) -> float:
        """Restart the timeline at boundary ``step`` reached (or resumed) at ``now`` with the
        step time of the current batch plus ``extra_s`` (a prefill chunk); returns it."""
        prev_end = self.t + (step - self.k) * self.dt
        self.k, self.t = step, now
        step_s = self.engine.sample_decode_step_s(len(self.running), self.kv_tokens(step)) if self.running else 0.0
        self.dt = extra_s + step_s
        self.seg_step.append(step)
        self.seg_time.append(now)
        self.seg_dt.append(self.dt)
        self.seg_gap.append(now + self.dt - prev_end)
        self.view_dirty = True
        return self.dt

    def runs(self, req: SimRequest, finish_step: int) -> list[tuple[float, int]]:
        """``(interval_s, count)`` runs of the request's token intervals: first token (end of
        prefill) → first decode step, then every step to ``finish_step``."""
        lo = req.join_step + 1
        out = [(self.time_of(lo) - req.first_token_s, 1)]
        if finish_step <= lo:
            return out
        steps, dts, gaps = self.seg_step, self.seg_dt, self.seg_gap
        i = bisect_right(steps, lo) - 1
        n = len(steps)
        while i < n and steps[i] < finish_step:
            a = max(lo + 1, steps[i] + 1)
            b = min(finish_step, steps[i + 1]) if i + 1 < n else finish_step
            if b >= a:
                if a == steps[i] + 1:
                    out.append((gaps[i], 1))
                    a += 1
                if b >= a:
                    out.append((dts[i], b - a + 1))
            i += 1
        return out
