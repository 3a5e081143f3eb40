"""A JSON POST for the server tests that read error bodies too (urllib: no client library in the way)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def post_json(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    """``(status, parsed JSON body)`` of a POST of ``body``; 4xx/5xx answers come back, not raised."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
