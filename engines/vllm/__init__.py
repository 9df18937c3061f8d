"""vLLM as an engine: kvstore as vLLM's KV pool through vLLM's KV connector API
(``connector.py``), and the small offline checkpoints its tests and benchmark run
(``checkpoint.py``). Importing this package does not import vLLM."""
