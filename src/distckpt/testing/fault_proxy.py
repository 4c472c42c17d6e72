"""An HTTP proxy on loopback that injects faults between a client and a server, for storage tests.

Point a client at the proxy instead of the server (for S3, set
``AWS_ENDPOINT_URL_S3`` to :attr:`FaultProxy.url`) and add rules; each
request that matches a rule gets its fault, the others pass through::

    with FaultProxy("http://127.0.0.1:9000") as proxy:
        proxy.add(Rule("drop_response", method="PUT", path=r"/metadata\\.json$", times=1))
        ...  # the commit PUT reaches the server, its answer never reaches the client
        assert proxy.hits("drop_response") == 1

Faults (``Rule.fault``):

- ``hang``: accept the request and never answer (until the proxy stops);
- ``status``: answer ``status`` (503 by default) without forwarding;
- ``drop_response``: forward the request, then close the connection unanswered;
- ``reset_body``: forward, send the headers and half the body, then close;
- ``delay``: wait ``delay_s`` seconds, then forward.

Only loopback upstreams are accepted: the proxy is for tests against a local server.
"""

from __future__ import annotations

import http.client
import ipaddress
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import urlsplit

__all__ = ["FaultProxy", "Rule"]

FAULTS = ("hang", "status", "drop_response", "reset_body", "delay")


@dataclass
class Rule:
    """A fault for the requests that match ``method`` (None: any), ``path`` and ``query`` (regular expressions
    searched in the request's path and query string; None: any), at most ``times`` times (None: always)."""

    fault: str
    method: Optional[str] = None
    path: Optional[str] = None
    query: Optional[str] = None
    times: Optional[int] = None
    status: int = 503
    delay_s: float = 1.0
    header: Optional[str] = None  # a request header that must be present (e.g. "If-None-Match", "Range")
    fired: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}; one of {FAULTS}")

    def matches(self, method: str, path: str, query: str, headers) -> bool:
        if self.times is not None and self.fired >= self.times:
            return False
        if self.method is not None and self.method.upper() != method:
            return False
        if self.path is not None and not re.search(self.path, path):
            return False
        if self.query is not None and not re.search(self.query, query):
            return False
        return self.header is None or self.header in headers


class FaultProxy:
    """A threaded HTTP/1.1 proxy from ``127.0.0.1:<free port>`` to ``upstream`` (a loopback URL)."""

    def __init__(self, upstream: str, timeout_s: float = 60.0):
        parts = urlsplit(upstream)
        if not ipaddress.ip_address(socket.gethostbyname(parts.hostname or "")).is_loopback:
            raise ValueError(f"FaultProxy forwards only to loopback servers, not {upstream!r}")
        self.upstream_host, self.upstream_port = parts.hostname, parts.port or 80
        self.timeout_s = timeout_s
        self.rules: list[Rule] = []
        self.log: list[tuple[str, str, str]] = []  # (method, path, what happened)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="fault-proxy", daemon=True)

    def start(self) -> "FaultProxy":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def add(self, rule: Rule) -> Rule:
        with self.lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self.lock:
            self.rules.clear()

    def hits(self, fault: Optional[str] = None) -> int:
        """Requests that got ``fault`` (None: every request seen)."""
        with self.lock:
            return sum(1 for _, _, what in self.log if fault is None or what == fault)

    def _pick(self, method: str, path: str, query: str, headers) -> Optional[Rule]:
        with self.lock:
            for rule in self.rules:
                if rule.matches(method, path, query, headers):
                    rule.fired += 1
                    self.log.append((method, path, rule.fault))
                    return rule
            self.log.append((method, path, "pass"))
            return None


def _handler(proxy: FaultProxy) -> type:
    """A request handler class bound to ``proxy`` (the server makes one handler per request)."""
    return type("Handler", (_Handler,), {"proxy": proxy})


class _Handler(BaseHTTPRequestHandler):
    """Reads a request, asks the proxy for its fault, and answers, forwarding to the upstream unless the fault
    answers in its place."""

    proxy: FaultProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _handle(self) -> None:
        body = self._body()
        path, _, query = self.path.partition("?")
        rule = self.proxy._pick(self.command, path, query, self.headers)
        fault = rule.fault if rule else None
        if fault == "hang":
            self.proxy.stopping.wait(self.proxy.timeout_s)
            self.close_connection = True
            return
        if fault == "status":
            self._answer_status(rule.status)
            return
        if fault == "delay":
            self.proxy.stopping.wait(rule.delay_s)
        status, reason, headers, payload = self._forward(body)
        if fault == "drop_response":
            self._cut()
            return
        self._relay(status, reason, headers, payload, cut_body=fault == "reset_body")

    def _answer_status(self, status: int) -> None:
        """Answer ``status`` in the upstream's place, with an S3-style error body."""
        payload = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _relay(self, status: int, reason: str, headers: list, payload: bytes, cut_body: bool) -> None:
        """Send the upstream's answer on; with ``cut_body``, its headers and half its body, then close."""
        self.send_response_only(status, reason)
        head = self.command == "HEAD"  # its Content-Length is the object's, with no body
        for name, value in headers:
            if name.lower() not in ("transfer-encoding", "connection") and (head or name.lower() != "content-length"):
                self.send_header(name, value)
        if not head:
            self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if cut_body and len(payload) > 1:
            self.wfile.write(payload[: len(payload) // 2])
            self.wfile.flush()
            self._cut()
            return
        if not head:
            self.wfile.write(payload)

    def _forward(self, body: bytes):
        conn = http.client.HTTPConnection(self.proxy.upstream_host, self.proxy.upstream_port, timeout=self.proxy.timeout_s)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "connection")}
            if body or self.command in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            payload = resp.read()
            return resp.status, resp.reason, resp.getheaders(), payload
        finally:
            conn.close()

    def _cut(self) -> None:
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle
