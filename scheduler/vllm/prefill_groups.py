"""Colocated vLLM instances: the seconds of their prefills, for the T_prefill fit.

A colocated instance's prefill ends when its first token reaches the front door; the router
books its seconds from when it was routed, or from when the prefill ahead of it in the
instance's books ended (first come first served, :class:`~scheduler.policy.backlog.PrefillBacklog`).
But vLLM runs several prefills in one engine step — its token budget (2,048 on the CPU)
holds a few short prompts, or a short prompt beside a long prompt's chunk — and their first
tokens arrive within milliseconds of each other. Booked one after another, the first took
the whole step's seconds and the others ~0: a live replay of 100 trace requests fed the fit
a 964-token prefill "computed in 0.000 s" among 23 of under 5 ms.

So prefills whose first tokens arrive within ``gap_s`` of the previous one on the same
instance form a group (at most ``max_members``: under a steady stream of first tokens a group
would never close), from the earliest booked start among them — never before the instance's
previous group ended, so that no second is learnt twice — to the last one's first token, and
the fit gets the group whole (:meth:`~scheduler.policy.costing.PrefillModel.observe_group`:
T_prefill is linear in its features, so a group's seconds are a point at the sum of its
prefills' features). A group is handed over once it is closed (a first token came more than
``gap_s`` after its last, a later group began there, or it is full) and every member's cached
tokens are known (vLLM's usage, at the request's end); a member that ended without them (a
cancelled or resumed stream) counts with the cached tokens the router planned for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

GAP_S = 0.1      # first tokens closer than this to the previous one on the instance: the same group
MAX_MEMBERS = 16


@dataclass
class _Group:
    instance: str
    start_s: float
    end_s: float
    floor_s: float = 0.0      # when the instance's previous group ended
    members: dict[str, list[int | None]] = field(default_factory=dict)   # id → [prompt, planned cached, cached]
    closed: bool = False


class PrefillGroups:
    """The open prefill groups of each instance (the module docstring). Times are the
    caller's monotonic clock; each method returns the groups it completed, as
    ``(prefills, seconds)`` with prefills a list of (prompt tokens, cached tokens)."""

    def __init__(self, gap_s: float = GAP_S, max_members: int = MAX_MEMBERS) -> None:
        self.gap_s, self.max_members = gap_s, max_members
        self._open: dict[str, _Group] = {}        # instance → its newest group
        self._of: dict[str, _Group] = {}          # request id → its group, until handed over
        self._ended: dict[str, float] = {}        # instance → when its last group ended

    def first_token(self, instance: str, request_id: str, prompt_tokens: int, planned_cached: int,
                    start_s: float, now_s: float) -> list[tuple[list[tuple[int, int]], float]]:
        """``request_id``'s first token came at ``now_s``; its prefill was booked from
        ``start_s``, planned with ``planned_cached`` tokens cached. It joins the instance's open
        group, or begins one (closing the other)."""
        done: list[tuple[list[tuple[int, int]], float]] = []
        group = self._open.get(instance)
        if group is None or group.closed or now_s - group.end_s > self.gap_s or len(group.members) >= self.max_members:
            if group is not None:
                group.closed = True
                done += self._hand_over(group)
            group = self._open[instance] = _Group(instance, now_s, now_s, self._ended.get(instance, 0.0))
        group.start_s = max(group.floor_s, min(group.start_s, start_s))
        group.members[request_id] = [prompt_tokens, planned_cached, None]
        group.end_s = max(group.end_s, now_s)
        self._ended[instance] = group.end_s
        self._of[request_id] = group
        return done

    def cached(self, request_id: str, cached_tokens: int, now_s: float) -> list[tuple[list[tuple[int, int]], float]]:
        """``request_id``'s cached tokens are known (its usage arrived at ``now_s``)."""
        group = self._of.get(request_id)
        if group is None:
            return []
        group.members[request_id][2] = cached_tokens
        if now_s - group.end_s > self.gap_s:
            group.closed = True
        return self._hand_over(group)

    def forget(self, request_id: str) -> list[tuple[list[tuple[int, int]], float]]:
        """The request is over: a member whose cached tokens never came counts with those
        planned for it."""
        group = self._of.pop(request_id, None)
        if group is None or group.members[request_id][2] is not None:
            return []
        group.members[request_id][2] = group.members[request_id][1]
        return self._hand_over(group)

    def _hand_over(self, group: _Group) -> list[tuple[list[tuple[int, int]], float]]:
        if not group.closed or any(m[2] is None for m in group.members.values()):
            return []
        for request_id in group.members:
            self._of.pop(request_id, None)
        if self._open.get(group.instance) is group:
            del self._open[group.instance]
        prefills = [(int(n or 0), int(c or 0)) for n, _, c in group.members.values()]
        return [(prefills, group.end_s - group.start_s)]
