"""The tier kinds a store node can run, as data: one :class:`TierKind` per kind, in
:data:`KINDS`, each with its name, its rank (fastest first), the read bandwidth the
scheduler prices it at until it has measured one, whether it keeps its blocks across a
restart, its default capacity and the factory that builds it from a node's configuration.

Everything that names a tier kind reads it from here: the pool's tier order
(:func:`ordered`), :class:`kvstore.config.StoreConfig`'s tier list and its TOML keys,
``kvstore serve``'s ``--tier`` / ``--hbm`` / ``--dram`` / ``--ssd`` flags, the prefix
index's tier ranks and ``scheduler/policy/costing.py``'s default bandwidths.

Adding a tier: write its :class:`kvstore.tiers.base.Tier` (a module under kvstore/tiers/,
imported by kvstore/tiers/__init__.py) and add one :class:`TierKind` to :data:`KINDS` with a
factory; ``kvstore serve --tier NAME=SIZE`` and ``tiers = [{kind = "NAME", bytes = "..."}]``
in the TOML then configure it, and the scheduler prices it at ``bandwidth_bytes_per_s``.

Bandwidths (bytes/s, reads on the same host): HBM 100e9 (an A100/H100's HBM2e/HBM3 is
1.5-3.3 TB/s; 100 GB/s is a conservative figure for a gather of scattered blocks), DRAM
6e9 and SSD 2e9 (measured by benchmarks/bench_pool.py: shared-memory copies at about
6 GB/s; LMDB reads from the page cache are faster, NVMe reads of cold blocks about 2 GB/s).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.errors import InvalidArgument

if TYPE_CHECKING:
    from kvstore.config import StoreConfig
    from kvstore.tiers.base import Tier


@dataclass(frozen=True, slots=True)
class TierKind:
    """One kind of tier. ``rank``: 0 is the fastest; a pool's tiers run in rank order.
    ``bandwidth_bytes_per_s``: its same-host read bandwidth (bytes/s), the scheduler's price
    until it measures one. ``persistent``: it keeps committed blocks across a restart (the
    pool indexes them when it opens). ``default_bytes``: its capacity when the node's
    configuration names none. ``build(cfg, capacity_bytes)``: the tier for a node."""

    name: str
    rank: int
    bandwidth_bytes_per_s: float
    persistent: bool
    default_bytes: int
    build: Callable[[StoreConfig, int], Tier]
    help: str = ""


def _hbm(cfg: StoreConfig, capacity: int) -> Tier:
    from kvstore.tiers.hbm import HbmTier
    return HbmTier(capacity, device=cfg.hbm_device)


def _dram(cfg: StoreConfig, capacity: int) -> Tier:
    from kvstore.tiers.dram import DramTier
    return DramTier(capacity, prefault=cfg.dram_prefault)


def _ssd(cfg: StoreConfig, capacity: int) -> Tier:
    from kvstore.tiers.ssd import SsdTier
    return SsdTier(capacity, path=os.path.join(cfg.data_dir, cfg.node_id, "ssd"), fsync=cfg.ssd_fsync)


HBM = TierKind("hbm", 0, 100e9, False, 0, _hbm,
               "HBM tier (device memory, on --hbm-device) above DRAM")
DRAM = TierKind("dram", 1, 6e9, False, 1 << 30, _dram,
                "DRAM tier (a shared-memory slab same-host readers map)")
SSD = TierKind("ssd", 2, 2e9, True, 4 << 30, _ssd,
               "SSD tier (LMDB under --data-dir; kept across restarts)")
KINDS: dict[str, TierKind] = {k.name: k for k in (HBM, DRAM, SSD)}


def kind(name: str) -> TierKind:
    """The kind called ``name``. Raises InvalidArgument naming the known kinds."""
    try:
        return KINDS[name]
    except KeyError:
        raise InvalidArgument(f"unknown tier {name!r}; tiers: {names()}") from None


def names() -> list[str]:
    """Every kind's name, fastest first."""
    return [k.name for k in sorted(KINDS.values(), key=lambda k: k.rank)]


def ordered(kinds: Iterable[str]) -> list[str]:
    """``kinds`` sorted fastest first. Raises InvalidArgument for an unknown one."""
    return sorted(kinds, key=lambda n: kind(n).rank)


def build_tiers(cfg: StoreConfig) -> list[Tier]:
    """The tiers of ``cfg.tier_list()``, fastest first. A persistent tier whose storage
    cannot be used raises OSError (one line), or with ``ssd_on_error = "disable"`` is left
    out (logged) while another tier remains; tiers built already are closed on a failure."""
    import logging

    tiers: list[Tier] = []
    skipped: OSError | None = None
    try:
        for spec in cfg.tier_list():
            k = kind(spec.kind)
            try:
                tiers.append(k.build(cfg, spec.capacity_bytes))
            except OSError as exc:
                if not k.persistent or cfg.ssd_on_error != "disable":
                    raise
                skipped = exc
                logging.getLogger(__name__).error("%s; serving without an %s tier (--ssd-on-error disable)",
                                                  exc, k.name.upper())
        if not tiers and skipped is not None:
            raise skipped
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers
