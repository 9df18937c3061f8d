"""The pool: tiers under one index, with leases, pins, quotas, eviction, demotion and promotion.

`pool.py` holds `KVPool` (the write side; reads in `reads.py`), `placement.py` decides where
blocks live, `moves.py` does the byte work of demotions and promotions outside the lock,
`reservations.py` the two-phase put, `lease.py` leases and pins, `eviction.py` the policies,
`tenants.py` and `quotas.py` the per-tenant books, `ledger.py` the usage ledger.
"""
