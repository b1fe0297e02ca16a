"""An HTTP server on loopback answering every request alike: a web page where an S3 endpoint should be, or an S3
server refusing with one error document (the tests of what S3 errors say)."""

from __future__ import annotations

import contextlib
import http.server
import threading
from typing import Iterator


class _Stub(http.server.BaseHTTPRequestHandler):
    answer = (404, "text/html", b"<html><body>Not Found</body></html>")  # status, content type, body

    def do_GET(self):
        status, kind, body = self.answer
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_PUT = do_HEAD = do_DELETE = do_POST = do_GET

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def answering(status: int, kind: str, body: bytes) -> Iterator[str]:
    """The endpoint URL of a server answering every request with ``status``, ``kind`` and ``body``."""
    handler = type("Answer", (_Stub,), {"answer": (status, kind, body)})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def s3_error(code: str, message: str) -> bytes:
    """An S3 error document."""
    return (b"<?xml version='1.0'?><Error><Code>%s</Code><Message>%s</Message><RequestId>R1</RequestId></Error>"
            % (code.encode(), message.encode()))
