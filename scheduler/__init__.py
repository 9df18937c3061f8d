"""The scheduler: the HTTP front door (OpenAI-compatible), the Conductor — Mooncake's
Algorithm 1 with prediction-based early rejection — and its baselines behind one pure decision
API (:mod:`scheduler.policy.views`, :mod:`scheduler.policy.conductor`, :mod:`scheduler.policy.baselines`), the
router that feeds it live state, request KV transfers, and Mooncake trace replay with its
report. Entry points: :mod:`scheduler.frontdoor.app`."""
