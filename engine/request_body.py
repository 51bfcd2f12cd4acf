"""A WSGI request's body under the app's MAX_CONTENT_LENGTH (gateway and node).

werkzeug answers 413 for a Content-Length past the limit, but cuts a chunked body off at the limit
without a word: the JSON then fails to parse and the client is told its body is not JSON.
"""
from __future__ import annotations

from flask import current_app, request
from werkzeug.exceptions import RequestEntityTooLarge


def request_body() -> bytes:
    """The whole body; RequestEntityTooLarge (413) when it is longer than MAX_CONTENT_LENGTH."""
    raw = request.get_data(cache=False)
    limit = current_app.config["MAX_CONTENT_LENGTH"]
    if request.content_length is None and len(raw) >= limit and request.environ["wsgi.input"].read(1):
        raise RequestEntityTooLarge()
    return raw
