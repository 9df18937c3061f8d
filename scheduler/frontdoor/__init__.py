"""The HTTP front door: the OpenAI-compatible API, its guards, metrics and status page.

`server.py` holds the request handlers, `app.py` builds the aiohttp application.
"""
