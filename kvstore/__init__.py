"""kvstore: a KV-cache-centric storage service for disaggregated LLM serving.

Packages: ``kvstore.index`` (block keys, prefix index), ``kvstore.tiers`` (byte storage per
tier), and in this package the pool, the gRPC store service and client, and the CLIs.
"""
__version__ = "0.1.0"
