"""The front door over vLLM instances: their registry, KV events, routing and mid-stream resume."""
