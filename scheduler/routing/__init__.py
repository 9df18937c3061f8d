"""The router: keys a request, reads the cache index, asks the policy, plans the KV moves.

`router.py` ties them together; `cache_index.py` is the replica of the store's index fed by KV
events; `route_plan.py` and `request_transfers.py` the chosen plan and its KV transfers.
"""
