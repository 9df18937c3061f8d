"""The scheduler: the HTTP front door (OpenAI-compatible), the Conductor — Mooncake's
Algorithm 1 with prediction-based early rejection — and its baselines behind one pure decision
API (:mod:`scheduler.views`, :mod:`scheduler.conductor`, :mod:`scheduler.baselines`), the
router that feeds it live state, request KV transfers, and Mooncake trace replay with its
report. Entry points: :mod:`scheduler.app`."""
