"""``s3://`` checkpoints against a hostile or failing S3 server: an HTTP proxy of ours (http.server in a
thread, on loopback) between tensorstore and moto's server changes chosen answers: a body cut short, a
connection reset mid-body, 503s, a redirect to another host, a listing whose pages never end or that omits
objects, lying ETags, another save's bytes, an answer that never finishes. Expected: a clear error naming
the object and what was wrong, never wrong values, nothing committed that is not whole, no hang, and
retries where the error is transient."""

from __future__ import annotations

import http.client
import http.server
import re
import secrets
import socket
import threading
from typing import Callable, List, Optional, Tuple

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.cli.main import main
from lightning_distckpt.core.errors import CheckpointingError, SaveFailedError
from dist_utils import run_distributed
from trust.hostile import run_bounded

pytest.importorskip("moto.server")
from s3_helpers import check, keys, marker, state, template  # noqa: E402

_SAFETY_S = 60  # only a net under a hang: the bound asserted is the error itself
_SLOW_DOWN = b"<Error><Code>SlowDown</Code><Message>Reduce your request rate.</Message></Error>"


class Answer:
    """An answer of the proxy: status, headers, body; ``cut`` sends only that many body bytes (under the full
    Content-Length) and then ``then``: "close", "reset" (RST) or "hold" (until the proxy is closed)."""

    def __init__(self, status: int, headers: List[Tuple[str, str]], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body
        self.length: Optional[int] = None  # a HEAD's Content-Length (its body is empty)
        self.cut: Optional[int] = None
        self.then = "close"


Rule = Callable[[str, str, Answer], None]  # (method, path with query, answer): may change the answer


class Proxy:
    """HTTP/1.1 between our S3 requests and moto: each request is passed on (``rewrite`` may change its path;
    ``refuse`` may answer it here without passing it on), then ``rule`` may change the answer. ``requests``
    lists ``(method, path)``; ``held`` is set once an answer is being held."""

    def __init__(self, upstream: str, rule: Optional[Rule] = None, rewrite: Optional[Callable[[str], str]] = None,
                 refuse: Optional[Callable[[str, str], Optional[Answer]]] = None) -> None:
        host, port = upstream.rsplit("//", 1)[1].split(":")
        self.upstream, self.rule, self.rewrite, self.refuse = (host, int(port)), rule, rewrite, refuse
        self.requests: List[Tuple[str, str]] = []
        self.held, self._release = threading.Event(), threading.Event()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _any

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return "http://127.0.0.1:%d" % self._server.server_address[1]

    def _forward(self, h: http.server.BaseHTTPRequestHandler, body: bytes) -> Answer:
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        path = self.rewrite(h.path) if self.rewrite else h.path
        conn.request(h.command, path, body=body, headers=dict(h.headers.items()))
        resp = conn.getresponse()
        out = Answer(resp.status, [(k, v) for k, v in resp.getheaders()
                                   if k.lower() not in ("content-length", "connection", "transfer-encoding")],
                     resp.read())
        conn.close()
        if h.command == "HEAD":
            out.length = int(resp.getheader("Content-Length") or 0)
        return out

    def _handle(self, h: http.server.BaseHTTPRequestHandler) -> None:
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        self.requests.append((h.command, h.path))
        ans = (self.refuse(h.command, h.path) if self.refuse else None) or self._forward(h, body)
        if self.rule is not None:
            self.rule(h.command, h.path, ans)
        h.send_response_only(ans.status)
        length = ans.length if h.command == "HEAD" and ans.length is not None else len(ans.body)
        for k, v in ans.headers + [("Content-Length", str(length))]:
            h.send_header(k, v)
        if ans.cut is not None:
            h.send_header("Connection", "close")
            h.close_connection = True
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(ans.body if ans.cut is None else ans.body[:ans.cut])
        h.wfile.flush()
        if ans.cut is not None and ans.then == "reset":  # RST, not FIN: SO_LINGER with a zero timeout
            h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        elif ans.cut is not None and ans.then == "hold":
            self.held.set()
            self._release.wait()

    def close(self) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def proxied(endpoint, bucket, monkeypatch):
    """``make(rule=..., rewrite=..., refuse=...)``: a proxy to moto that every S3 request of this process (and of
    ranks it spawns) goes through from then on."""
    made = []

    def make(**hooks) -> Proxy:
        p = Proxy(endpoint, **hooks)
        made.append(p)
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
        return p

    yield make
    for p in made:
        p.close()


def _is_list(path: str) -> bool:
    return "list-type=2" in path


def _one_line(error: BaseException, *parts: str) -> None:
    text = str(error)
    assert "\n" not in text and all(p in text for p in parts), text


# -- listings -------------------------------------------------------------------------------------------------
def _endless(method: str, path: str, ans: Answer) -> None:
    """Every listing (but the bucket check's, of the marker alone) says it is truncated, with a token."""
    if _is_list(path) and not path.endswith("COMMITTED"):
        ans.body = ans.body.replace(b"<IsTruncated>false</IsTruncated>",
                                    b"<IsTruncated>true</IsTruncated><NextContinuationToken>t</NextContinuationToken>")


def _first_page_again(path: str) -> str:
    """A continuation token is dropped: moto answers the first page again (and knows no token of ours)."""
    return re.sub(r"continuation-token=[^&]*&?", "", path)


#: The bounds the tests set (seconds): long enough that moto's own answers, on a busy machine, come well within
#: them; the hostile answer never comes, so only this bound ends the wait.
_BOUND_S = 5


@pytest.mark.parametrize("op", ["load", "save", "clean", "validate"])
def test_a_listing_whose_pages_never_end_fails_within_its_bound(bucket, proxied, monkeypatch, capsys, op):
    """A server answering every listing "truncated, continue with token t", forever: tensorstore gathers every
    page before it answers, so the load (a writer's store is listed before it is opened), the save (its
    version's name is listed before it is claimed), ``clean`` and ``validate`` hung forever, the keys they
    gathered growing without bound. Now the listing is cancelled after LIGHTNING_DISTCKPT_S3_LIST_TIMEOUT."""
    url = f"s3://{bucket}/ck"
    ldc.save(state(1), url)
    proxy = proxied(rule=_endless, rewrite=_first_page_again)
    monkeypatch.setenv("LIGHTNING_DISTCKPT_S3_LIST_TIMEOUT", str(_BOUND_S))
    calls = {"load": lambda: ldc.load(template(), url), "save": lambda: ldc.save(state(2), url),
             "clean": lambda: main(["clean", f"s3://{bucket}"]), "validate": lambda: main(["validate", url])}
    got = run_bounded(calls[op], _SAFETY_S)
    assert sum(_is_list(p) for _, p in proxy.requests) > 1  # the endless pages were served
    if op in ("clean", "validate"):  # validate reports it as the problem found (exit 1)
        assert got.get("value") == (2 if op == "clean" else 1), got
        text = capsys.readouterr().err.strip() if op == "clean" else capsys.readouterr().out.splitlines()[0]
    else:
        assert isinstance(got.get("error"), CheckpointingError), got
        text = str(got["error"])
    assert f"the endpoint {proxy.url} did not end the listing within {_BOUND_S} s" in text, text
    assert "LIGHTNING_DISTCKPT_S3_LIST_TIMEOUT" in text and f"s3://{bucket}" in text and "\n" not in text, text


def test_a_listing_omitting_a_writers_store_at_the_commit_commits_nothing(bucket, endpoint, proxied):
    """The commit's listing of the version (``check_complete``) omits rank 0's store objects: taken for a store
    deleted while the save ran, nothing is committed, and the previous checkpoint loads."""
    url = f"s3://{bucket}/ck"
    ldc.save(state(1), url)

    def omit(method: str, path: str, ans: Answer) -> None:
        if _is_list(path) and path.endswith("%2Fdata%2F"):
            ans.body = re.sub(rb"<Contents><Key>[^<]*/data/rank_00000/(?!claim-)[^<]*</Key>.*?</Contents>", b"",
                              ans.body, flags=re.S)

    proxied(rule=omit)
    with pytest.raises(SaveFailedError, match=r"the store of rank\(s\) \[0\] is missing"):
        ldc.save(state(2), url)
    check(ldc.load(template(), url), 1)


# -- transient and lasting failures ---------------------------------------------------------------------------
def _cut(how: str) -> Callable[[Answer], None]:
    def apply(ans: Answer) -> None:
        if how == "503":
            ans.status, ans.headers, ans.body = 503, [], _SLOW_DOWN
        else:  # half the body under the full Content-Length, then FIN or RST
            ans.cut, ans.then = len(ans.body) // 2, {"short body": "close", "reset mid-body": "reset"}[how]
    return apply


_WORDS = {"503": "SlowDown: Reduce your request rate.", "short body": "broke off its answer (Transferred a partial",
          "reset mid-body": "broke off its answer ("}
_SOME = [("COMMITTED", "short body"), ("metadata.json", "reset mid-body"), ("common.pt", "503")]  # each way once
_ALL = [(name, how) for name in ("COMMITTED", "metadata.json", "common.pt", "/d/") for how in _WORDS]


@pytest.mark.parametrize("name,how", _SOME + [pytest.param(*c, marks=pytest.mark.long) for c in _ALL if c not in _SOME])
def test_a_failing_get_is_retried_and_a_lasting_failure_names_the_object(bucket, proxied, name, how):
    """Once: retried, the load bit-exact. Always: one line naming the object; a cut answer said as the endpoint
    breaking off its answer (it was said to be "unreachable", which it was not)."""
    url = f"s3://{bucket}/ck"
    ldc.save(state(1), url)
    hits = {"n": 0, "always": False}

    def fail(method: str, path: str, ans: Answer) -> None:
        if method == "GET" and not _is_list(path) and name in path and ans.body:
            hits["n"] += 1
            if hits["n"] == 1 or hits["always"]:
                _cut(how)(ans)

    proxied(rule=fail)
    check(ldc.load(template(), url), 1)
    assert hits["n"] >= 2  # the failed request was sent again
    hits["always"] = True
    with pytest.raises(CheckpointingError) as raised:
        ldc.load(template(), url)
    _one_line(raised.value, url, name.strip("/"))
    if name != "/d/":  # ours: said in words; tensorstore's array reads quote curl, naming the object and range
        _one_line(raised.value, _WORDS[how])


@pytest.mark.parametrize("async_save", [False, pytest.param(True, marks=pytest.mark.long)])
def test_put_failures_are_retried_and_a_lasting_one_commits_nothing(bucket, endpoint, proxied, async_save):
    """503 (the request refused, not carried out) on every other PUT: each retried, the save commits and loads
    bit-exact. 503 on every PUT of the marker: the save (its async commit too) fails naming it, its version is
    removed, and the previous checkpoint loads."""
    url = f"s3://{bucket}/ck"
    ldc.save(state(1), url)
    puts = {"n": 0, "marker": False}

    def refuse(method: str, path: str) -> Optional[Answer]:
        if method != "PUT":
            return None
        puts["n"] += 1
        if (not puts["marker"] and puts["n"] % 2) or (puts["marker"] and path.endswith("/COMMITTED")):
            return Answer(503, [], _SLOW_DOWN)
        return None

    def save(seed: int) -> None:
        saver = ldc.AsyncSaver() if async_save else False
        request = ldc.save(state(seed), url, async_save=saver)
        if request is not None:
            request.finalize()

    proxied(refuse=refuse)
    if not async_save:  # the retries are tensorstore's, alike for both
        save(2)
        check(ldc.load(template(), url), 2)
    puts["marker"] = True
    before = keys(endpoint, bucket)
    with pytest.raises(CheckpointingError) as raised:
        save(3)
    _one_line(raised.value, url, "nothing was committed", "writing COMMITTED failed", "SlowDown")
    assert keys(endpoint, bucket) == before  # its version removed, the previous one untouched
    check(ldc.load(template(), url), 1 if async_save else 2)


def test_a_redirect_to_another_host_is_not_followed_and_said_so(bucket, endpoint, proxied):
    url = f"s3://{bucket}/ck"
    ldc.save(state(1), url)
    elsewhere = Proxy(endpoint)
    try:
        def redirect(method: str, path: str, ans: Answer) -> None:
            if path.split("?")[0].endswith("/COMMITTED"):
                ans.status, ans.headers, ans.body = 301, [("Location", elsewhere.url + path)], b""

        proxied(rule=redirect)
        with pytest.raises(CheckpointingError) as raised:
            ldc.load(template(), url)
        _one_line(raised.value, url, "reading COMMITTED failed", "answered with a redirect (HTTP 301), which is "
                  "not followed")
        assert elsewhere.requests == []  # no request (nor the credentials' signature) went to the other host
    finally:
        elsewhere.close()


# -- lies -----------------------------------------------------------------------------------------------------
def test_lying_etags_do_not_change_what_is_saved_or_loaded(bucket, proxied):
    """Every answer with a new random ETag (OCDBT's manifest reads are conditional on it): saved and loaded
    bit-exact, no loop."""
    def lie(method: str, path: str, ans: Answer) -> None:
        ans.headers = [(k, v) for k, v in ans.headers if k.lower() != "etag"] + [("ETag", f'"{secrets.token_hex(16)}"')]

    proxied(rule=lie)
    url = f"s3://{bucket}/ck"
    got = run_bounded(lambda: (ldc.save(state(3), url), ldc.load(template(), url))[1], _SAFETY_S)
    check(got["value"], 3)


def _big(seed: int) -> dict:
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.randn(256, 256, generator=torch.Generator()
                                                                      .manual_seed(seed))), "step": seed}


@pytest.mark.parametrize("lie", ["a flipped byte", "another save's store"] + [
    pytest.param(lie, marks=pytest.mark.long) for lie in ("another save's metadata.json", "another save's common.pt")])
def test_bytes_that_lie_are_refused_never_loaded(bucket, endpoint, proxied, lie):
    """The server answers a read of this checkpoint with other bytes: one flipped in a data object, or whole
    objects (a writer's store, metadata.json, common.pt) of another save of the same shapes. A checksum (or the
    save's token) refuses each: a FormatError naming the checkpoint, never other values."""
    ldc.save(_big(1), f"s3://{bucket}/a")
    ldc.save(_big(2), f"s3://{bucket}/b")
    va, vb = marker(endpoint, bucket, "a")["version"], marker(endpoint, bucket, "b")["version"]
    mine, theirs = f"/{bucket}/b/{vb}/", f"/{bucket}/a/{va}/"
    swap = {"another save's store": "data/", "another save's metadata.json": "metadata.json",
            "another save's common.pt": "common.pt"}.get(lie)

    def flip(method: str, path: str, ans: Answer) -> None:
        if lie == "a flipped byte" and "/d/" in path and len(ans.body) > 100_000:
            body = bytearray(ans.body)
            body[len(body) // 2] ^= 0x10
            ans.body = bytes(body)

    proxied(rule=flip, rewrite=lambda p: p.replace(mine + swap, theirs + swap) if swap else p)
    out = torch.zeros(256, 256)
    with pytest.raises(CheckpointingError) as raised:
        ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", out)}, f"s3://{bucket}/b")
    _one_line(raised.value, f"s3://{bucket}/b")
    assert not torch.equal(out, _big(1)["w"].data)  # never the other save's values


# -- answers that never finish --------------------------------------------------------------------------------
def _load_error(rank: int, world: int, url: str) -> str:
    try:
        ldc.load(template(rank, world), url, storage=ldc.StorageOptions(s3_retries=1))
    except CheckpointingError as e:
        return str(e)
    return "loaded"


@pytest.mark.parametrize("name", ["COMMITTED", pytest.param("/d/", marks=pytest.mark.long)])  # /d/: a fresh rank
def test_an_answer_that_never_finishes_is_bounded(bucket, proxied, monkeypatch, name):
    """Half the body, then nothing, the connection held open: the marker (a small request) fails within
    LIGHTNING_DISTCKPT_S3_TIMEOUT; a data object (a transfer that may rightly be long) within curl's stall limit
    per attempt (TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS, read once per process: a fresh rank here)."""
    url = f"s3://{bucket}/ck"
    ldc.save(state(1), url)

    def hold(method: str, path: str, ans: Answer) -> None:
        if method == "GET" and not _is_list(path) and name in path and len(ans.body) > 1:
            ans.cut, ans.then = len(ans.body) // 2, "hold"

    proxy = proxied(rule=hold)
    monkeypatch.setenv("LIGHTNING_DISTCKPT_S3_TIMEOUT", str(_BOUND_S))
    monkeypatch.setenv("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", "1")
    if name == "COMMITTED":  # the answer bound is read at each request: this process
        text = run_bounded(lambda: _load_error(0, 1, url), _SAFETY_S)["value"]
    else:
        ranks = run_bounded(lambda: run_distributed(_load_error, 1, url, timeout_s=_SAFETY_S), _SAFETY_S + 30)
        text = ranks["value"][0]
    assert proxy.held.is_set()
    assert url in text and "\n" not in text, text
    if name == "COMMITTED":
        assert f"reading COMMITTED failed: the endpoint {proxy.url} did not answer within {_BOUND_S} s" in text, text
    else:
        assert "/d/" in text and "Operation too slow" in text, text


# -- a write that landed, answered as failed ------------------------------------------------------------------
def test_a_manifest_put_that_landed_but_was_answered_500_is_retried(bucket, proxied):
    """A manifest PUT stored, then answered 500: tensorstore's retry fails ALREADY_EXISTS against its own first
    attempt; that attempt reads back whole (``storage/landed_commit.py``), so the save commits and loads
    bit-exact (more cases: ``test_s3_landed_writes.py``)."""
    hits = {"n": 0}

    def lost(method: str, path: str, ans: Answer) -> None:
        if method == "PUT" and path.endswith("/manifest.ocdbt"):
            hits["n"] += 1
            if hits["n"] == 1:
                ans.status, ans.headers, ans.body = 500, [], b"<Error><Code>InternalError</Code></Error>"

    proxied(rule=lost)
    url = f"s3://{bucket}/ck"
    ldc.save(state(4), url)
    check(ldc.load(template(), url), 4)
