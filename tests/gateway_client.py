"""A tiny blocking HTTP client for tests that talk to Envoy (stdlib only, exact bytes in and out)."""

from __future__ import annotations

import http.client
from dataclasses import dataclass
from urllib.parse import urlparse


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):  # noqa: ANN201
        import json

        return json.loads(self.body)

    def error_message(self) -> str:
        """The reason of a picker rejection: OpenAI's `error.message` on JSON replies, else the text line."""
        if self.headers.get("content-type", "").startswith("application/json"):
            return self.json()["error"]["message"]
        return self.body.decode().strip()


def request(url: str, method: str = "POST", path: str = "/v1/chat/completions", body: bytes | None = None,
            headers: dict[str, str] | list[tuple[str, str]] | None = None, timeout: float = 30) -> Reply:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.putrequest(method, path)
        items = headers.items() if isinstance(headers, dict) else (headers or [])
        names = set()
        for k, v in items:
            conn.putheader(k, v)
            names.add(k.lower())
        if body is not None:
            if "content-type" not in names:
                conn.putheader("content-type", "application/json")
            conn.putheader("content-length", str(len(body)))
        conn.endheaders(body)
        r = conn.getresponse()
        return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    finally:
        conn.close()
