"""Where and when a benchmark ran: :func:`write_results` and :func:`run_info` live in
launcher/run_info.py, which ``kvstore up``'s reports use too."""
from launcher.run_info import commit, machine, run_info, write_results

__all__ = ["commit", "machine", "run_info", "write_results"]
