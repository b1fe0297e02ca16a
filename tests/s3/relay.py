"""A loopback TCP relay between our S3 requests and moto's server, for tests that must see or change the
traffic: it counts the bytes the server sends back (``served``), lists the request lines (``requests``),
runs ``on_request(method, path)`` before a request is passed on, and answers a request that
``deny(method, path)`` picks (the path without its query) with S3's 403 AccessDenied, whose XML body names an
access key as S3's does (``denied``), instead of passing it on."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from typing import Callable, List, Optional, Tuple

LEAKS = ("<?xml", "<Error>", "AKIALEAKEDKEYID", "RequestId")  # what an error of ours must not quote
_DENIED_BODY = (b"<?xml version='1.0'?><Error><Code>AccessDenied</Code><Message>Access Denied</Message>"
                b"<AWSAccessKeyId>AKIALEAKEDKEYID</AWSAccessKeyId><RequestId>R1</RequestId></Error>")
_DENIED = (b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\nConnection: close\r\n"
           b"Content-Length: %d\r\n\r\n" % len(_DENIED_BODY)) + _DENIED_BODY
_REQUEST = re.compile(rb"(GET|PUT|HEAD|DELETE|POST) (/[^ ]*) HTTP/1\.1\r\n")
Hook = Callable[[str, str], object]


class Relay:
    def __init__(self, upstream: Tuple[str, int], on_request: Optional[Hook] = None,
                 deny: Optional[Hook] = None) -> None:
        self.upstream, self.on_request, self.deny = upstream, on_request, deny
        self.served = 0
        self.requests: List[Tuple[str, str]] = []
        self.denied: List[Tuple[str, str]] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._open = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    @classmethod
    def to(cls, endpoint: str, **hooks: Optional[Hook]) -> "Relay":
        """A relay to the server at ``endpoint`` (``http://host:port``)."""
        host, port = endpoint.rsplit("//", 1)[1].split(":")
        return cls((host, int(port)), **hooks)

    @property
    def url(self) -> str:
        return "http://127.0.0.1:%d" % self._listener.getsockname()[1]

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream)
            self._open += [down, up]
            threading.Thread(target=self._pump, args=(down, up, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, False), daemon=True).start()

    def _seen(self, line: "re.Match[bytes]", src: socket.socket) -> bool:
        """A request line: recorded, hooked; True when it was denied (answered here)."""
        method, path = line.group(1).decode(), line.group(2).decode()
        self.requests.append((method, path))
        if self.on_request is not None:
            self.on_request(method, path)
        if self.deny is not None and self.deny(method, path.split("?")[0]):
            self.denied.append((method, path.split("?")[0]))
            src.sendall(_DENIED)
            return True
        return False

    def _pump(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        tail = b""
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if requests:  # request lines (the tail: one split between two reads)
                    if any(self._seen(m, src) for m in _REQUEST.finditer(tail + data)):
                        break
                    tail = data[-300:]
                else:
                    with self._lock:
                        self.served += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        for s in self._open:
            with contextlib.suppress(OSError):
                s.close()
