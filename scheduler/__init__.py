"""The scheduler: the HTTP front door (OpenAI-compatible), routing of requests to prefill and
decode engines (the thin Conductor policy), admission with early rejection, and Mooncake trace
replay with its report. Entry points: :mod:`scheduler.app`."""
