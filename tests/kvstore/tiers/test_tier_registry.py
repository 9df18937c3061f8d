"""Tiers as data (kvstore/tiers/registry.py): the kinds' order, a node's tier list
(StoreConfig: ``tiers`` or the ``<kind>_bytes`` keys, from TOML and flags), the tiers built
from it, ``kvstore serve``'s tier flags and ``choices=`` derived from the registries, and the
scheduler's prices, which refuse a tier nobody registered."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.config import StoreConfig, TierSpec
from kvstore.errors import InvalidArgument
from kvstore.index.prefix_index import TIER_ORDER
from kvstore.pool.eviction import POLICIES
from kvstore.tiers import registry
from kvstore.tiers.dram import DramTier
from kvstore.tiers.ssd import SsdTier
from launcher.cli import build_parser
from scheduler.policy.costing import Bandwidths, TransferModel

MIB = 1 << 20


def test_kinds_run_fastest_first_and_unknown_kinds_are_named() -> None:
    assert registry.names() == ["hbm", "dram", "ssd"] == list(TIER_ORDER)
    assert [registry.kind(n).persistent for n in registry.names()] == [False, False, True]
    assert registry.ordered(["ssd", "hbm", "dram"]) == ["hbm", "dram", "ssd"]
    with pytest.raises(InvalidArgument, match="'nvme'.*hbm.*dram.*ssd"):
        registry.kind("nvme")


def test_the_tier_list_comes_from_the_size_keys_or_from_tiers() -> None:
    assert StoreConfig().tier_list() == (TierSpec("dram", 1 << 30), TierSpec("ssd", 4 << 30))
    cfg = StoreConfig(hbm_bytes=2 * MIB, ssd_bytes=0)
    assert [t.kind for t in cfg.tier_list()] == ["hbm", "dram"]
    listed = StoreConfig(tiers=(TierSpec("dram", MIB), TierSpec("ssd", 8 * MIB)))
    assert listed.tier_list() == (TierSpec("dram", MIB), TierSpec("ssd", 8 * MIB))
    assert listed.tier_capacity("ssd") == 8 * MIB and listed.tier_capacity("hbm") == 0


@pytest.mark.parametrize("tiers, match", [
    ((TierSpec("ssd", MIB), TierSpec("dram", MIB)), "fastest first"),
    ((TierSpec("dram", MIB), TierSpec("dram", MIB)), "at most once"),
])
def test_a_bad_tier_list_is_refused(tiers: tuple[TierSpec, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StoreConfig(tiers=tiers)


def test_bad_tiers_and_no_tier_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown tier 'nvme'"):
        TierSpec("nvme", MIB)
    for bad in (0, -1, 2**63):
        with pytest.raises(ValueError, match=r"capacity must be a whole number of bytes in \(0, 2\*\*63\)"):
            TierSpec("dram", bad)
    with pytest.raises(ValueError, match="KIND=SIZE"):
        TierSpec.parse("dram")
    with pytest.raises(ValueError, match="needs a tier"):
        StoreConfig(dram_bytes=0, ssd_bytes=0)


def test_toml_takes_a_tier_list_and_flags_replace_it(tmp_path: Path) -> None:
    toml = tmp_path / "node.toml"
    toml.write_text('tiers = [{kind = "dram", bytes = "2MiB"}, {kind = "ssd", bytes = "16MiB"}]\n')
    cfg = StoreConfig.load(str(toml))
    assert cfg.tier_list() == (TierSpec("dram", 2 * MIB), TierSpec("ssd", 16 * MIB))
    # A list given as flags replaces the file's, and so do size keys given with it.
    over = StoreConfig.load(str(toml), tiers=[TierSpec.parse("dram=4MiB")])
    assert over.tier_list() == (TierSpec("dram", 4 * MIB),)
    with pytest.raises(ValueError, match="not both"):
        StoreConfig.load(str(toml), dram_bytes="4MiB")
    toml.write_text('tiers = [{kind = "dram"}]\n')
    with pytest.raises(ValueError, match="kind = NAME, bytes = SIZE"):
        StoreConfig.load(str(toml))



@pytest.mark.parametrize("text, match", [
    ("dram_bytes = 1.5\n", "whole number of bytes or a string with a unit"),    # was a 1-byte tier
    ('dram_bytes = "1.5"\n', "not a whole number of bytes"),
    ("dram_bytes = true\n", "cannot read True as a size"),
    ("tiers = []\n", "names no tier"),                                          # was the defaults
    ("dram_bytes = = 3\n", "node.toml is not valid TOML"),
    ("\udcff dram_bytes = 3\n", "node.toml is not valid TOML: not UTF-8"),             # was unnamed
    ('high_watermark = "x"\n', "high_watermark must be a number, got 'x'"),           # was a TypeError
    ("lease_ttl_s = true\n", "lease_ttl_s must be a number, got True"),
])
def test_a_settings_file_that_says_something_impossible_is_refused_naming_it(tmp_path: Path, text: str,
                                                                             match: str) -> None:
    toml = tmp_path / "node.toml"
    toml.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ValueError, match=match):
        StoreConfig.load(str(toml))
    toml.write_text('dram_bytes = "1.5KiB"\n')
    assert StoreConfig.load(str(toml)).tier_capacity("dram") == 1536

def test_build_tiers_builds_the_list_in_order(tmp_path: Path) -> None:
    cfg = StoreConfig(data_dir=str(tmp_path), dram_prefault=False,
                      tiers=(TierSpec("dram", MIB), TierSpec("ssd", 4 * MIB)))
    tiers = registry.build_tiers(cfg)
    try:
        assert [type(t) for t in tiers] == [DramTier, SsdTier]
        assert [t.capacity_bytes for t in tiers] == [MIB, 4 * MIB]
        assert isinstance(tiers[1], SsdTier) and tiers[1].path == str(tmp_path / "node-0" / "ssd")
    finally:
        for tier in tiers:
            tier.close()


def test_build_tiers_can_leave_out_an_unusable_ssd(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    bad = {"data_dir": str(blocked), "dram_prefault": False, "tiers": (TierSpec("dram", MIB), TierSpec("ssd", MIB))}
    with pytest.raises(OSError, match="cannot use data directory"):
        registry.build_tiers(StoreConfig(**bad))   # type: ignore[arg-type]
    tiers = registry.build_tiers(StoreConfig(**bad, ssd_on_error="disable"))   # type: ignore[arg-type]
    try:
        assert [t.name for t in tiers] == ["dram"]
    finally:
        for tier in tiers:
            tier.close()


def test_serve_flags_come_from_the_registries() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--tier", "dram=1MiB", "--tier", "ssd=2MiB", "--policy", "s3fifo"])
    assert args.tier == [TierSpec("dram", MIB), TierSpec("ssd", 2 * MIB)]
    assert parser.parse_args(["serve", "--ssd", "3MiB"]).ssd_bytes == "3MiB"
    serve = next(a for a in parser._subparsers._group_actions[0].choices["serve"]._actions  # type: ignore[union-attr]
                 if "--policy" in a.option_strings)
    assert set(serve.choices) == set(POLICIES)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--tier", "nvme=1MiB"])


def test_prices_refuse_a_tier_nobody_registered() -> None:
    bw = Bandwidths()
    assert bw.tier("ssd") == registry.SSD.bandwidth_bytes_per_s
    assert Bandwidths(ssd=1e9).tier("ssd") == 1e9
    with pytest.raises(InvalidArgument, match="unknown tier 'nvme'"):
        bw.tier("nvme")
    model = TransferModel(MIB, bw)
    assert model.local_s([("ssd", 2)]) == pytest.approx(2 * MIB / registry.SSD.bandwidth_bytes_per_s)
    with pytest.raises(InvalidArgument, match="unknown tier 'nvme'"):
        model.remote_s([("nvme", 1)])
