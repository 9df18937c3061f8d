"""The front doors' HTTP server log: a client's malformed request is the client's mistake,
not the server's error.

aiohttp's server logs every request its parser refuses — a bad header, a bad
``Content-Length`` or chunk size, a body that is not the transfer coding it claims — at
ERROR with a full traceback (``aiohttp.server``: "Error handling request", or "Unhandled
exception" when it meets the bad bytes while draining a body after the answer). It has
answered that client with a 400 already; no key is needed to send one, so anyone who can
reach the port could grow the log by a traceback per connection. :class:`ClientErrorFilter`
turns those records into one DEBUG line (dropped unless ``aiohttp.server`` logs DEBUG);
errors of the server's own are left as they are.
"""
from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError

SERVER_LOGGER = "aiohttp.server"


class ClientErrorFilter(logging.Filter):
    """Passes every record but those whose exception is an HTTP 4xx of aiohttp's parser
    (:class:`aiohttp.http_exceptions.HttpProcessingError`): those become one DEBUG line
    without the traceback, or are dropped when the logger does not log DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not (isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 0) < 500):
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return False
        message = " ".join(str(exc.message).split())
        record.msg, record.args = f"{record.getMessage()}: {exc.code} {message}", ()
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        record.exc_info, record.exc_text = None, None
        return True


def quiet_client_errors() -> None:
    """Install :class:`ClientErrorFilter` on aiohttp's server logger (once per process)."""
    logger = logging.getLogger(SERVER_LOGGER)
    if not any(isinstance(f, ClientErrorFilter) for f in logger.filters):
        logger.addFilter(ClientErrorFilter())
