"""The Conductor and the baselines at the policy level: plain frozen views in, a Decision or
a Rejection out (no processes): load balance against cache affinity, admission on TTFT,
prediction-based early rejection on decode, tier-aware costing and the baselines' shared
code path. The online fits: tests/scheduler/policy/test_fits.py."""
from __future__ import annotations

import math

import pytest

from scheduler.policy.admission import AdmissionConfig, Rejection
from scheduler.policy.baselines import POLICIES, make_policy
from scheduler.policy.conductor import Conductor, ConductorConfig
from scheduler.policy.costing import Bandwidths, PrefillModel, PrefillProfile, TransferModel
from scheduler.policy.tbt import DecodeProfile, load_at
from scheduler.policy.views import (
    POOL,
    ClusterView,
    Decision,
    DecodeView,
    DecodeWork,
    PrefillView,
    RequestView,
    TierHit,
    load_limit,
)

BS = 16
BLOCK_BYTES = 8192


def keys(*ids: int) -> tuple[bytes, ...]:
    return tuple(i.to_bytes(8, "big") for i in ids)


def request(n_tokens: int, key_ids: tuple[int, ...] = (), max_tokens: int = 8, rid: str = "r") -> RequestView:
    return RequestView(rid, n_tokens, keys(*key_ids), max_tokens, BS)


def cluster(prefill: tuple[PrefillView, ...], decode: tuple[DecodeView, ...] | None = None,
            pool: TierHit = TierHit(), now: float = 0.0, inflight: int = 0) -> ClusterView:
    return ClusterView(now, prefill, decode or (DecodeView("d0"),), pool, inflight)


def conductor(**kw) -> Conductor:
    admission = kw.pop("admission", AdmissionConfig())
    return Conductor(BLOCK_BYTES, ConductorConfig(admission=admission, **kw))


# -- load balance against cache affinity ----------------------------------------------------
def run_shared_prefix(policy: Conductor, n_requests: int = 200) -> dict[str, int]:
    """``n_requests`` requests one after another sharing a 2-block prefix (plus one unique
    block and a tail), arriving faster than one instance prefills them. The caller's side of
    the API in miniature: queues drain with time, a chosen instance then holds the whole
    prompt (its own blocks and what it fetched), the pool holds every prompt."""
    held: dict[str, set[bytes]] = {"p0": set(), "p1": set()}
    pool: set[bytes] = set()
    busy_until = {"p0": 0.0, "p1": 0.0}
    queued: dict[str, list[float]] = {"p0": [], "p1": []}
    counts = {"p0": 0, "p1": 0}
    one = policy.prefill_model.predict(3 * BS + 5, 2 * BS)
    now = 0.0
    for i in range(n_requests):
        now += 0.6 * one
        chain = keys(1, 2, 1000 + i)
        views = []
        for name in ("p0", "p1"):
            queued[name] = [t for t in queued[name] if t > now]
            hit = 0
            while hit < len(chain) and chain[hit] in held[name]:
                hit += 1
            views.append(PrefillView(name, max(0.0, busy_until[name] - now), len(queued[name]),
                                     TierHit.uniform(hit, "hbm")))
        pool_hit = 0
        while pool_hit < len(chain) and chain[pool_hit] in pool:
            pool_hit += 1
        d = policy.decide(RequestView(f"r{i}", 3 * BS + 5, chain, 4, BS),
                          cluster(tuple(views), pool=TierHit.uniform(pool_hit, "dram"), now=now))
        assert isinstance(d, Decision), d
        busy_until[d.prefill_id] = max(busy_until[d.prefill_id], now) + (d.ttft_s - d.queue_s)
        queued[d.prefill_id].append(busy_until[d.prefill_id])
        held[d.prefill_id].update(chain)      # it keeps what it fetched and what it computed
        pool.update(chain)
        counts[d.prefill_id] += 1
    return counts


def test_shared_prefix_spreads_over_two_equal_instances():
    counts = run_shared_prefix(conductor())
    assert sum(counts.values()) == 200
    assert max(counts.values()) <= 0.7 * 200, counts


@pytest.mark.parametrize("peer_fetch", [False, True])
def test_queue_on_the_holder_sends_the_request_elsewhere_once_recompute_is_cheaper(peer_fetch):
    policy = conductor(peer_fetch=peer_fetch)
    req = request(2 * BS + 8, (1, 2))
    predict = policy.prefill_model.predict
    saving = predict(req.prompt_tokens, 0) - predict(req.prompt_tokens, 2 * BS)
    assert saving > 0
    holder = TierHit.uniform(2, "hbm")
    for queue_s, want in [(0.5 * saving, "p0"), (20 * 1e-3 + 2 * saving, "p1")]:
        d = policy.decide(req, cluster((PrefillView("p0", queue_s, 20, holder), PrefillView("p1", 0.0, 0))))
        assert isinstance(d, Decision) and d.prefill_id == want, (queue_s, d)
        if want == "p1" and d.fetch is not None:   # a fetch is taken only when it pays
            assert d.fetch.source == "p0" and d.fetch.transfer_s <= saving


def test_a_miss_goes_to_the_least_loaded_instance():
    policy = conductor()
    for q0, q1, want in [(0.5, 0.1, "p1"), (0.1, 0.5, "p0"), (0.0, 0.0, "p0")]:
        d = policy.decide(request(100, (7, 8, 9, 10, 11, 12)),
                          cluster((PrefillView("p0", q0, 2), PrefillView("p1", q1, 2))))
        assert isinstance(d, Decision) and d.prefill_id == want and d.fetch is None and d.cached_tokens == 0


# -- admission on TTFT -----------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_idle_cluster_without_measurements_admits_a_2k_prompt(name):
    policy = make_policy(name, BLOCK_BYTES, ConductorConfig(admission=AdmissionConfig(ttft_slo_s=2.0)))
    assert policy.prefill_model.samples == 0
    d = policy.decide(request(2048, tuple(range(128))), cluster((PrefillView("p0"), PrefillView("p1"))))
    assert isinstance(d, Decision) and d.ttft_s < 2.0


def test_an_unmeasured_profile_never_implies_less_than_the_floor_speed():
    model = PrefillModel(PrefillProfile(fixed_s=0.01, s_per_token=1.0, floor_tokens_per_s=2000.0))
    assert model.predict(2048) <= 0.01 + 2048 / 2000.0 + 1e-9
    for _ in range(8):   # once measured, the measurements rule
        model.observe(1000, 0, 3.0)
    assert model.predict(1000) == pytest.approx(3.0, rel=0.05)


def test_idle_instances_never_reject_even_with_a_pessimistic_fit():
    policy = conductor(admission=AdmissionConfig(ttft_slo_s=0.5, tbt_slo_s=0.001))
    for _ in range(10):
        policy.observe_prefill(1000, 0, 5.0)     # a very slow engine, measured
        policy.observe_decode(1, 100, 0.5)
    rejected = 0
    for n in (16, 256, 2048, 4000):
        r = policy.decide(request(n, max_tokens=64), cluster((PrefillView("p0"), PrefillView("p1"))))
        rejected += isinstance(r, Rejection)
    assert rejected == 0


def test_saturated_queues_reject_with_a_reason_and_retry_after():
    policy = conductor(admission=AdmissionConfig(ttft_slo_s=2.0))
    r = policy.decide(request(512), cluster((PrefillView("p0", 5.0, 20), PrefillView("p1", 7.5, 30))))
    assert isinstance(r, Rejection) and r.reason == "ttft_slo" and r.retry_after_s >= 3
    assert r.ttft_s > 2.0 and "TTFT SLO" in r.message
    full = conductor(admission=AdmissionConfig(max_inflight=4)).decide(
        request(512), cluster((PrefillView("p0"),), inflight=4))
    assert isinstance(full, Rejection) and full.reason == "max_inflight" and full.retry_after_s >= 1


# -- prediction-based early rejection on decode ----------------------------------------------
def decode_full_now(finish_s: float, now: float = 100.0) -> DecodeView:
    return DecodeView("d0", (DecodeWork(500, now - 1, now + finish_s), DecodeWork(500, now - 2, now + finish_s)),
                      max_running=2)


def test_decode_full_now_but_free_when_prefill_ends_is_admitted():
    policy = conductor()
    prefill = (PrefillView("p0", 0.2, 4),)          # prefill ends in > 0.2 s
    d = policy.decide(request(256, max_tokens=16), cluster(prefill, (decode_full_now(0.05),), now=100.0))
    assert isinstance(d, Decision) and d.decode_id == "d0" and d.decode_start_s > 100.05
    assert d.decode_running == 1
    # Judged on the load now (the baseline rule), the same request is turned away.
    now_rule = conductor(admission=AdmissionConfig(predicted_decode_load=False))
    r = now_rule.decide(request(256, max_tokens=16), cluster(prefill, (decode_full_now(0.05),), now=100.0))
    assert isinstance(r, Rejection) and r.reason == "decode_capacity"


def test_decode_still_full_when_prefill_ends_is_rejected_before_prefill():
    policy = conductor()
    r = policy.decide(request(256, max_tokens=16),
                      cluster((PrefillView("p0", 0.2, 4),), (decode_full_now(10.0),), now=100.0))
    assert isinstance(r, Rejection) and r.reason == "decode_capacity"
    assert 9 <= r.retry_after_s <= 11


def test_requests_still_in_prefill_count_against_decode():
    # Room now (1 of 2), but two admitted requests join decode before this one gets there.
    work = (DecodeWork(100, 99.0, 150.0), DecodeWork(100, 100.05, 150.0), DecodeWork(100, 100.1, 150.0))
    r = conductor().decide(request(64), cluster((PrefillView("p0", 0.2, 2),),
                                                (DecodeView("d0", work, max_running=2),), now=100.0))
    assert isinstance(r, Rejection) and r.reason == "decode_capacity"
    assert load_at(DecodeView("d0", work), 100.0).running == 1


def test_requests_admitted_to_join_later_reserve_decode_room():
    # Room when this one arrives (the running request left), but a request admitted earlier
    # joins after it and stays: predictive admission counts it as reserved capacity.
    work = (DecodeWork(100, 99.0, 100.001), DecodeWork(100, 150.0, 300.0))
    view = DecodeView("d0", work, max_running=1)
    arrive = 100.0 + conductor().prefill_model.predict(64)
    assert load_at(view, arrive).running == 0 and load_at(view, arrive, arrive + 100.0).running == 1
    assert load_at(view, arrive, 149.0).running == 0          # it leaves before the other joins
    r = conductor().decide(request(64, max_tokens=20_000), cluster((PrefillView("p0", 0.2, 1),), (view,), now=100.0))
    assert isinstance(r, Rejection) and r.reason == "decode_capacity"
    short = conductor().decide(request(64, max_tokens=8), cluster((PrefillView("p0", 0.2, 1),), (view,), now=100.0))
    assert isinstance(short, Decision)                        # done long before the other joins


def test_a_request_of_n_sequences_counts_n_in_flight_in_the_batch_and_its_kv():
    """OpenAI's ``n``: one prompt, ``n`` sequences decoding side by side (vLLM's front door
    passes it on). Each takes a batch slot, its own ``max_tokens`` of KV, and a place in
    flight; counted once, one request could hold 16 slots on a bound of 1."""
    def req(n: int, max_tokens: int = 8) -> RequestView:
        return RequestView("r", 64, (), max_tokens, BS, sequences=n)

    assert req(3).kv_tokens == 64 + 3 * 8
    capped = conductor(admission=AdmissionConfig(max_inflight=6))
    over = capped.decide(req(4), cluster((PrefillView("p0"),), inflight=3))
    assert isinstance(over, Rejection) and over.reason == "max_inflight" and "4 sequences" in over.message
    assert isinstance(capped.decide(req(3), cluster((PrefillView("p0"),), inflight=3)), Decision)
    # Two sequences running (one request of n=2) of a batch of 4: n=2 fits, n=3 does not.
    view = DecodeView("d0", (DecodeWork(100, 0.0, 500.0, 2),), max_running=4)
    assert load_at(view, 1.0).running == 2 and load_at(view, 1.0, 2.0).ending == ((500.0, 100, 2),)
    fits = conductor().decide(req(2), cluster((PrefillView("p0"),), (view,), now=1.0))
    assert isinstance(fits, Decision) and fits.decode_running == 4
    full = conductor().decide(req(3), cluster((PrefillView("p0"),), (view,), now=1.0))
    assert isinstance(full, Rejection) and full.reason == "decode_capacity"
    assert 400 <= full.retry_after_s <= 500                        # when the n=2 request leaves
    # KV: 3 sequences of 400 tokens do not fit 1,200 tokens beside a 64-token prompt; 2 do.
    small = DecodeView("d0", (), max_running=8, kv_capacity_tokens=1200)
    assert isinstance(conductor().decide(req(3, 400), cluster((PrefillView("p0"),), (small,))), Rejection)
    assert isinstance(conductor().decide(req(2, 400), cluster((PrefillView("p0"),), (small,))), Decision)
    # More sequences than the batch holds can never be served: no retry will help soon.
    never = conductor().decide(req(5), cluster((PrefillView("p0"),), (DecodeView("d0", (), max_running=4),)))
    assert isinstance(never, Rejection) and never.reason == "decode_capacity" and never.retry_after_s >= 60


def test_a_tenant_bound_counts_sequences():
    admission = conductor(admission=AdmissionConfig(max_inflight_per_tenant=4)).admission
    assert admission.check_tenant(2, 2) is None
    busy = admission.check_tenant(2, 3)
    assert busy is not None and busy.reason == "tenant_max_inflight" and "3 sequences" in busy.message
    assert admission.check_tenant(4) is not None and admission.check_tenant(3) is None


def test_colocated_decodes_on_the_chosen_prefill_instance():
    idle_full = (PrefillView("c0"), PrefillView("c1", 0.5, 3))
    # at 1.0 c0 decodes one request for 0.2 s more (its T_queue: 0.2 s), another in prefill joins at 1.1
    full = DecodeView("c0", (DecodeWork(100, 0.0, 1.2), DecodeWork(100, 1.1, 500.0)), max_running=1)
    free = DecodeView("c1", (), max_running=1)
    disagg = conductor().decide(request(64), cluster(idle_full, (full, free), now=1.0))
    assert isinstance(disagg, Decision) and (disagg.prefill_id, disagg.decode_id) == ("c0", "c1")
    view = ClusterView(1.0, idle_full, (full, free), colocated=True)
    r = conductor().decide(request(64), view)
    assert isinstance(r, Rejection) and r.reason == "decode_capacity"      # c0's own batch is full
    roomy = ClusterView(1.0, idle_full, (DecodeView("c0"), free), colocated=True)
    d = conductor().decide(request(64), roomy)
    assert isinstance(d, Decision) and d.prefill_id == d.decode_id == "c0"


def test_colocated_t_queue_counts_the_decode_batch_still_running():
    """Colocated, an instance's T_queue is its prefill queue plus the seconds until the batch it
    decodes now drains (Dynamo counts an aggregated worker's decode blocks likewise): of two
    instances with no prefill queued and the same hit, the one decoding less gets the prompt;
    disaggregated, and for the paper's baselines, the prefill queue alone counts."""
    prefill = (PrefillView("c0"), PrefillView("c1"))
    decoding = DecodeView("c0", (DecodeWork(500, 0.0, 3.0), DecodeWork(500, 0.5, 2.0),   # batch drains at 3.0
                                 DecodeWork(500, 4.0, 9.0)))                              # joins later: not yet
    short = DecodeView("c1", (DecodeWork(500, 0.0, 1.5),))
    view = ClusterView(1.0, prefill, (decoding, short), colocated=True)
    guessing = conductor()          # seeds only: the decode wait is not weighed yet
    assert not guessing.predictors_measured and guessing.decide(request(64), view).prefill_id == "c0"
    for i in range(8):
        guessing.observe_prefill(100 + 50 * i, 0, 0.01 + 1e-4 * (100 + 50 * i))
        guessing.observe_decode(1 + i % 3, 1000 * (1 + i), 0.01 + 0.002 * (i % 3) + 1e-6 * 1000 * (1 + i))
    assert guessing.predictors_measured and guessing.decide(request(64), view).prefill_id == "c1"
    policy = conductor(prefill=PrefillProfile(learn=False), decode=DecodeProfile(learn=False))   # frozen: in use
    assert policy.decode_waits(view) == {"c0": 2.0, "c1": 0.5}
    d = policy.decide(request(64), ClusterView(1.0, prefill, (decoding, short), colocated=True))
    assert isinstance(d, Decision) and d.prefill_id == d.decode_id == "c1"
    assert d.queue_s == pytest.approx(0.5) and d.ttft_s == pytest.approx(0.5 + d.transfer_s + d.prefill_s)
    # the prefill queue still counts beside it: c1 with 2 s queued loses to c0's 2 s of decode + 0
    queued = (PrefillView("c0", 0.0), PrefillView("c1", 2.0, 1))
    d = policy.decide(request(64), ClusterView(1.0, queued, (decoding, short), colocated=True))
    assert isinstance(d, Decision) and d.prefill_id == "c0" and d.queue_s == pytest.approx(2.0)
    disagg = policy.decide(request(64), ClusterView(1.0, prefill, (decoding, short)))
    assert isinstance(disagg, Decision) and disagg.prefill_id == "c0" and disagg.queue_s == 0.0
    for name in ("least_loaded", "local_cache_aware"):
        base = make_policy(name, BLOCK_BYTES, ConductorConfig())
        b = base.decide(request(64), ClusterView(1.0, prefill, (decoding, short), colocated=True))
        assert isinstance(b, Decision) and b.prefill_id == "c0" and b.queue_s == 0.0, name
    # vLLM runs prefill chunks in its decode steps: no drain to wait for (a live replay sent
    # requests behind a 7,540-token prefill for a 27-s decode wait predicted on the other instance)
    chunked = conductor(prefill=PrefillProfile(learn=False), decode=DecodeProfile(learn=False), chunked_prefill=True)
    d = chunked.decide(request(64), ClusterView(1.0, queued, (decoding, short), colocated=True))
    assert isinstance(d, Decision) and d.prefill_id == "c0" and d.queue_s == 0.0


def test_least_predicted_tbt_decode_and_tbt_slo():
    busy = DecodeView("d0", tuple(DecodeWork(4000, 0.0, 50.0) for _ in range(8)))
    calm = DecodeView("d1", (DecodeWork(100, 0.0, 50.0),))
    d = conductor().decide(request(64), cluster((PrefillView("p0"),), (busy, calm), now=1.0))
    assert isinstance(d, Decision) and d.decode_id == "d1"
    strict = conductor(admission=AdmissionConfig(tbt_slo_s=1e-4))
    r = strict.decide(request(64), cluster((PrefillView("p0"),), (busy, calm), now=1.0))
    assert isinstance(r, Rejection) and r.reason == "tbt_slo" and r.tbt_s > 1e-4


# -- tier-aware costing --------------------------------------------------------------------------
def test_each_tier_costs_its_own_transfer_time():
    t = TransferModel(BLOCK_BYTES, Bandwidths(hbm=100e9, dram=6e9, ssd=1e9, network=2e9, fetch_latency_s=0))
    assert t.local_s([("hbm", 10)]) == 0.0
    assert t.local_s([("dram", 10)]) == pytest.approx(10 * BLOCK_BYTES / 6e9)
    assert t.local_s([("ssd", 10)]) == pytest.approx(10 * BLOCK_BYTES / 1e9)
    assert t.remote_s([("dram", 10)]) == pytest.approx(10 * BLOCK_BYTES / 2e9)   # network-bound
    assert t.remote_s([("ssd", 10)]) == pytest.approx(10 * BLOCK_BYTES / 1e9)    # disk-bound
    for _ in range(30):   # measured: SSD reads here run at 0.1 GB/s
        t.observe("ssd", 1 << 20, (1 << 20) / 0.1e9)
    assert t.remote_s([("ssd", 10)]) == pytest.approx(10 * BLOCK_BYTES / 0.1e9, rel=0.01)
    assert t.remote_s([("dram", 10)]) == pytest.approx(10 * BLOCK_BYTES / 2e9)
    assert TierHit.from_tiers(["hbm", "hbm", "dram", "ssd", "ssd"]).between(1, 5) == (
        ("hbm", 1), ("dram", 1), ("ssd", 2))


@pytest.mark.parametrize("ssd_bps,fetches", [(6e9, True), (1e3, False)])
def test_pool_prefix_is_fetched_only_when_cheaper_than_recomputing(ssd_bps, fetches):
    policy = conductor(bandwidths=Bandwidths(ssd=ssd_bps, network=10e9, fetch_latency_s=1e-4))
    req = request(64 * BS + 3, tuple(range(64)))
    d = policy.decide(req, cluster((PrefillView("p0"),), pool=TierHit.uniform(64, "ssd")))
    assert isinstance(d, Decision)
    if fetches:
        assert d.fetch is not None and d.fetch.source == POOL and d.fetch.blocks == 64
        assert d.cached_tokens == 64 * BS and d.transfer_s > 0
    else:
        assert d.fetch is None and d.cached_tokens == 0
    # The engine is told: a recompute decision limits what it loads from the pool.
    assert load_limit(d, TierHit.uniform(64, "ssd"), BS) == (None if fetches else 0)


def test_load_limit_leaves_the_engine_free_when_the_pool_had_nothing_longer():
    d = conductor().decide(request(4 * BS + 1, (1, 2, 3, 4)),
                           cluster((PrefillView("p0", hit=TierHit.uniform(2, "hbm")),)))
    assert isinstance(d, Decision) and d.cached_tokens == 2 * BS
    assert load_limit(d, TierHit.uniform(2, "dram"), BS) is None       # nothing longer: any later hit
    assert load_limit(d, TierHit.uniform(3, "dram"), BS) == 2           # chose to recompute block 3


def test_an_observed_transfer_moves_the_tier_estimate():
    policy = conductor(bandwidths=Bandwidths(dram=6e9, network=1e9, fetch_latency_s=0))
    before = policy.transfer.remote_s([("dram", 10)])
    assert before == pytest.approx(10 * BLOCK_BYTES / 1e9)              # the seeded default
    policy.observe_transfer("dram", 10 * BLOCK_BYTES, 10 * BLOCK_BYTES / 0.1e9)   # measured 0.1 GB/s
    after = policy.transfer.remote_s([("dram", 10)])
    assert before < after < 10 * BLOCK_BYTES / 0.1e9
    assert policy.transfer.remote_s([("ssd", 10)]) == pytest.approx(10 * BLOCK_BYTES / 1e9)   # others kept


def test_a_hit_on_the_whole_prompt_still_computes_the_last_token():
    d = conductor().decide(request(4 * BS, (1, 2, 3, 4)),
                           cluster((PrefillView("p0", hit=TierHit.uniform(4, "hbm")),)))
    assert isinstance(d, Decision) and d.cached_tokens == 4 * BS - 1 and d.compute_tokens == 1


# -- baselines: one code path -----------------------------------------------------------------------
def test_baselines_choose_as_named():
    views = (PrefillView("p0", 0.3, 3, TierHit.uniform(4, "hbm")), PrefillView("p1", 0.1, 1),
             PrefillView("p2", 0.2, 2, TierHit.uniform(2, "hbm")))
    req = request(6 * BS, (1, 2, 3, 4, 5, 6))
    rr = make_policy("round_robin", BLOCK_BYTES)
    assert [rr.decide(req, cluster(views)).prefill_id for _ in range(4)] == ["p0", "p1", "p2", "p0"]
    assert make_policy("least_loaded", BLOCK_BYTES).decide(req, cluster(views)).prefill_id == "p1"
    # local cache-aware weighs the queue against its own prefix: p1's 0.1 s of queue beats
    # p0's 0.3 s less the few ms its 4 cached blocks save (test_baselines.py: the definition)
    assert make_policy("local_cache_aware", BLOCK_BYTES).decide(req, cluster(views)).prefill_id == "p1"
    rnd = [make_policy("random", BLOCK_BYTES, ConductorConfig(seed=s)).decide(req, cluster(views)).prefill_id
           for s in range(20)]
    assert set(rnd) == {"p0", "p1", "p2"}
    for name in POLICIES:      # the same admission for everyone
        r = make_policy(name, BLOCK_BYTES, ConductorConfig(admission=AdmissionConfig(ttft_slo_s=0.05))).decide(
            req, cluster(tuple(PrefillView(v.instance_id, 1.0, 5) for v in views)))
        assert isinstance(r, Rejection) and r.reason == "ttft_slo", name
    with pytest.raises(Exception, match="valid"):
        make_policy("nope", BLOCK_BYTES)


def test_decisions_are_deterministic_and_views_immutable():
    views = (PrefillView("p0", 0.1, 1, TierHit.uniform(2, "hbm")), PrefillView("p1"))
    a = conductor().decide(request(100, (1, 2, 3, 4, 5, 6)), cluster(views, pool=TierHit.uniform(6, "dram")))
    b = conductor().decide(request(100, (1, 2, 3, 4, 5, 6)), cluster(views, pool=TierHit.uniform(6, "dram")))
    assert a == b
    with pytest.raises(AttributeError):
        views[0].queue_s = 1.0   # type: ignore[misc]
    assert math.isclose(a.ttft_s, a.queue_s + a.transfer_s + a.prefill_s)


@pytest.mark.parametrize("peer_fetch,threshold,source", [(True, 1.0, "p0"), (False, 1.0, None), (True, 1e6, None)])
def test_a_busy_holder_lends_its_prefix_to_an_idle_instance(peer_fetch, threshold, source):
    """The prefix is only in p0's cache and p0 is busy: p1 wins, and fetches the prefix from
    p0 when the fetch beats recomputing by the balancing threshold."""
    policy = conductor(peer_fetch=peer_fetch, balancing_threshold=threshold)
    req = request(64 * BS + 5, tuple(range(64)))
    d = policy.decide(req, cluster((PrefillView("p0", 5.0, 20, TierHit.uniform(64, "hbm")), PrefillView("p1"))))
    assert isinstance(d, Decision) and d.prefill_id == "p1"
    if source is None:
        assert d.fetch is None and d.cached_tokens == 0
    else:
        assert d.fetch.source == source and (d.fetch.first_block, d.fetch.blocks) == (0, 64)
        assert d.cached_tokens == 64 * BS and d.transfer_s == d.fetch.transfer_s > 0
        assert d.ttft_s < policy.prefill_model.predict(req.prompt_tokens, 0)

