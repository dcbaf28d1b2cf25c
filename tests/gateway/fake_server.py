"""A stand-in for the gateway over real HTTP, for the client's tests: a ``ThreadingHTTPServer`` on a
local port whose requests a test's functions answer (canned JSON, a proxy's error page, a
refusal). Django-free, as the remote workers it serves."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# A request's answer: its status, its body (a dict is sent as JSON, bytes as they are, with no
# Content-Type) and any more headers.
Reply = tuple[int, dict | bytes, dict[str, str]]
Answer = Callable[[str], Reply]  # from the request's path


@contextmanager
def fake_gateway(*, get: Answer | None = None, post: Answer | None = None) -> Iterator[str]:
    """A real HTTP server answering GETs with ``get`` and POSTs with ``post`` (a method without
    one is not served: 501); yields its URL, ``http://127.0.0.1:PORT``. A POST's body is read and
    dropped."""

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, answer: Answer) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, body, headers = answer(self.path)
            data = json.dumps(body).encode() if isinstance(body, dict) else body
            self.send_response(status)
            if isinstance(body, dict):
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    if get is not None:
        Handler.do_GET = lambda self: self._reply(get)  # type: ignore[attr-defined]
    if post is not None:
        Handler.do_POST = lambda self: self._reply(post)  # type: ignore[attr-defined]
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
