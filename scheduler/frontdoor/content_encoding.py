"""A request body's ``Content-Encoding``, decoded by the front doors themselves (with zlib)
instead of by aiohttp's parser, which they run with ``auto_decompress=False``.

Why not aiohttp's: a coding it cannot decode (``br`` or ``zstd`` without their packages)
fails in its HTTP parser, before any handler or middleware, so the answer was a plain-text
400 telling the client to install Brotli and every such request logged a traceback at
ERROR — on any path, ``/health`` included, with no key needed; and a body that was not the
gzip it claimed logged another traceback when aiohttp drained it after the answer. Here the
handler that reads the body decodes it, and every refusal is an OpenAI-shaped 4xx.

Codings (RFC 9110 §8.4.1): ``gzip`` (and ``x-gzip``; up to :data:`MAX_GZIP_MEMBERS`
concatenated members), ``deflate`` (the zlib format, or raw deflate as some clients send
it), ``identity``. Any other, or more than one (on one header line or several), is 415
``unsupported_media_type``. The decoded body is bounded as the raw one is: past ``limit``
bytes it is 413 ``request_too_large``, found while decompressing (a small bomb never grows
past the limit in memory). Decoding takes up to ~0.2 s for a 32 MiB body; zlib releases
the GIL while it inflates, so the caller runs it in a thread and the event loop goes on
(:func:`scheduler.frontdoor.request_parts.parse_json_body`).
"""
from __future__ import annotations

import zlib

from scheduler.frontdoor.openai_api import APIError

IDENTITY = frozenset({"", "identity"})
# Clients send one member; each further one cost a copy of the rest of the body (150,000
# empty members, 3 MB, held the event loop 8 s before the bound), so a few are taken, no more.
MAX_GZIP_MEMBERS = 16
_GZIP_WBITS = 16 + zlib.MAX_WBITS
_WBITS = {"gzip": _GZIP_WBITS, "x-gzip": _GZIP_WBITS, "deflate": zlib.MAX_WBITS}


def decode_body(raw: bytes, content_encoding: str | None, limit: int) -> bytes:
    """``raw`` decoded as ``content_encoding`` (the header's value; None or ``identity``:
    as is). Raises APIError: 415 for a coding not listed in the module docstring, 400 for
    bytes that are not the coding claimed (or end before its stream does), 413 when the
    decoded body would pass ``limit`` bytes."""
    coding = (content_encoding or "").strip().lower()
    if coding in IDENTITY:
        return raw
    wbits = _WBITS.get(coding)
    if wbits is None:
        raise APIError(415, f"Content-Encoding {content_encoding!r} is not supported; send the body as is, or "
                            f"as one of gzip, deflate", code="unsupported_media_type")
    try:
        if coding == "deflate":
            try:
                return _inflate(raw, wbits, limit, coding)
            except zlib.error:
                return _inflate(raw, -zlib.MAX_WBITS, limit, coding)   # raw deflate, no zlib header
        return _inflate(raw, wbits, limit, coding)
    except zlib.error as exc:
        raise APIError(400, f"the request body could not be read as Content-Encoding {coding!r}: {exc}",
                       code="invalid_body") from None


def _inflate(raw: bytes, wbits: int, limit: int, coding: str) -> bytes:
    out = bytearray()
    data = raw
    for _ in range(MAX_GZIP_MEMBERS):
        d = zlib.decompressobj(wbits)
        while data:
            out += d.decompress(data, limit + 1 - len(out))
            if len(out) > limit:
                raise APIError(413, f"the request body decompresses to more than the limit of {limit} bytes",
                               code="request_too_large")
            data = d.unconsumed_tail
        if not d.eof:
            raise APIError(400, f"the request body could not be read as Content-Encoding {coding!r}: "
                                "it ends before the compressed stream does", code="invalid_body")
        data = d.unused_data
        if not data or wbits != _GZIP_WBITS:   # one more gzip member follows; else done
            if data:
                raise APIError(400, f"the request body could not be read as Content-Encoding {coding!r}: "
                                    f"{len(data)} bytes follow the end of the compressed stream",
                               code="invalid_body")
            return bytes(out)
    raise APIError(400, f"the request body could not be read as Content-Encoding {coding!r}: more than "
                        f"{MAX_GZIP_MEMBERS} gzip members", code="invalid_body")
