"""Prefill and decode engines around a real torch model (Hugging Face ``transformers``), and
the async client the scheduler uses to call them."""
