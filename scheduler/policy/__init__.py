"""Routing policy as pure decisions: the Conductor, the paper's baselines, the peer routers.

Nothing here does I/O: each policy reads views of the instances (`views.py`) and returns a
decision. `registry.py` names them for `--policy`.
"""
