"""Where new blocks go across nodes: by free capacity, a prefix chain kept together."""
from __future__ import annotations


def plan_chain(sizes: list[int], free: dict[str, int], prefer: str | None = None,
               replicas: int = 1) -> list[tuple[str, int, int]]:
    """Runs ``(node_id, start, end)`` covering blocks ``[0, len(sizes))`` of one chain.

    The chain goes to ``prefer`` (the node holding its parent) when it has room, else to the
    node with the most free bytes; when that node fills, the rest spills to the next most
    free, and so on. When no node has room left the remainder goes to the most free node
    anyway (its pool evicts). With ``replicas`` > 1 each block is also placed on
    ``replicas - 1`` other nodes (fewer when fewer exist), by the same rule.

    Args:
        sizes: bytes of each block, head first.
        free: node id -> free bytes (below its high watermark).
    """
    if not free:
        return []
    left = dict(free)
    runs = _one_copy(sizes, left, prefer)
    copies: list[tuple[str, int, int]] = []
    for node_id, start, end in runs:
        holders = {node_id}
        for _ in range(1, replicas):
            others = [n for n in free if n not in holders]
            if not others:
                break
            target = max(others, key=lambda n: (left[n], n))
            left[target] -= sum(sizes[start:end])
            holders.add(target)
            copies.append((target, start, end))
    return runs + copies


def _one_copy(sizes: list[int], free: dict[str, int], prefer: str | None) -> list[tuple[str, int, int]]:
    """One copy of the chain, filling ``free`` (updated in place) node by node."""
    order = sorted(free, key=lambda n: (-free[n], n))
    if prefer in order and free[prefer] >= (sizes[0] if sizes else 0):
        order.remove(prefer)
        order.insert(0, prefer)
    runs: list[tuple[str, int, int]] = []
    i, k = 0, 0
    while i < len(sizes):
        node = order[k] if k < len(order) else order[0]
        start = i
        while i < len(sizes) and (free[node] >= sizes[i] or k >= len(order)):
            free[node] -= sizes[i]
            i += 1
        if i > start:
            runs.append((node, start, i))
        k += 1
    return runs
