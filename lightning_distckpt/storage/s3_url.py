"""``s3://bucket/prefix`` locations: parsing, tensorstore's ``s3`` kvstore spec for one, and
failures of S3 requests as one line naming the URL. No I/O here (see :mod:`.s3`).

Endpoint, region and credentials come from the standard AWS environment (``AWS_ENDPOINT_URL``,
``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` + ``AWS_SECRET_ACCESS_KEY`` or
``AWS_PROFILE``), each overridable in :class:`~lightning_distckpt.storage.options.StorageOptions`.
With no credentials configured at all a URL is refused before any request: the SDK's default
chain would otherwise probe the instance metadata service.
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict, NamedTuple, Optional, Tuple

from ..core.errors import ArgumentError
from .options import StorageOptions

S3_SCHEME = "s3://"
# A server that accepts the connection but never replies fails a request only after curl's stall
# limit (60 s without 256 bytes/s, tensorstore's default) on every attempt: about 5 minutes with
# s3_retries=4. The requests that open every operation (the bucket check, the marker, a 1-byte size
# probe) move a few bytes, so waiting on them is bounded as a whole, retries included.
S3_TIMEOUT_ENV = "LIGHTNING_DISTCKPT_S3_TIMEOUT"
DEFAULT_S3_TIMEOUT_S = 60.0
# A listing is one request per page of 1,000 keys, and tensorstore gathers every page before it answers: a
# server whose pages never end (a truncated answer with a continuation token, forever) held it, and the keys
# it gathered, without bound. So a listing is waited on for at most this long as a whole, then cancelled;
# listings of a checkpoint's objects take well under a second, and one of a large bucket a few minutes.
S3_LIST_TIMEOUT_ENV = "LIGHTNING_DISTCKPT_S3_LIST_TIMEOUT"
DEFAULT_S3_LIST_TIMEOUT_S = 600.0
DEFAULT_REGION = "us-east-1"  # what S3-compatible servers (and tensorstore with an endpoint) expect
# OCDBT over S3: reads of one data object less than 1 MiB apart are merged into one ranged GET of
# at most 64 MiB (one default chunk). Every small shard, zarr.json and B-tree node is otherwise its
# own request: a 588-tensor, 64 MiB state loaded in 295 GETs (21 s against moto on loopback, one
# process), merged in 26 (1.9 s); on S3 each GET costs a first-byte latency and a request fee.
S3_READ_COALESCING = {
    "experimental_read_coalescing_threshold_bytes": 1 << 20,
    "experimental_read_coalescing_merged_bytes": 64 << 20,
    "experimental_read_coalescing_interval": "10ms",
}
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]\Z")


class S3Location(NamedTuple):
    """A bucket and a key prefix in it (no leading or trailing ``/``; ``""`` for the bucket's root)."""

    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        return f"{S3_SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{S3_SCHEME}{self.bucket}"


def parse_s3_url(url: str) -> S3Location:
    """The location of ``s3://bucket/a/b`` (``/`` runs and a trailing ``/`` collapsed); an
    ArgumentError naming the URL for an invalid bucket name, a ``.``/``..`` component or a control
    character."""
    bucket, _, rest = url[len(S3_SCHEME):].partition("/")
    if not _BUCKET.match(bucket):
        raise ArgumentError(f"checkpoint {url}: {bucket!r} is not a valid S3 bucket name")
    if _has_control(rest):  # a newline would reach requests and the server's answer
        raise ArgumentError(f"checkpoint {url!r}: control characters are not allowed in an S3 key prefix")
    parts = [p for p in rest.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise ArgumentError(f"checkpoint {url}: '.' and '..' are not allowed in an S3 key prefix")
    return S3Location(bucket, "/".join(parts))


def _has_control(text: str) -> bool:
    return any(ord(c) < 0x20 or c == "\x7f" for c in text)


def nameable(component: str) -> bool:
    """Whether a URL can name a location whose key holds ``component`` (:func:`parse_s3_url`
    collapses empty components and refuses ``.``, ``..`` and control characters): a key a hostile
    writer put elsewhere is then at no location a save writes to, and is left alone."""
    return component not in ("", ".", "..") and not _has_control(component)


def endpoint(options: StorageOptions) -> Optional[str]:
    return options.s3_endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def _split_userinfo(ep: str) -> Tuple[str, str, str]:
    """``(scheme://, user:password, host and path)`` of an endpoint (the scheme may be missing)."""
    scheme, sep, rest = ep.partition("://")
    if not sep:
        scheme, rest = "", ep
    host, slash, path = rest.partition("/")
    userinfo, at, host = host.rpartition("@")
    return scheme + sep, userinfo + at, host + slash + path


def shown_endpoint(options: StorageOptions) -> str:
    """The endpoint as errors show it: a ``user:password@`` in it replaced by ``***@`` (never printed)."""
    ep = endpoint(options)
    if not ep:
        return "of AWS S3"
    scheme, userinfo, rest = _split_userinfo(ep)
    return f"{scheme}***@{rest}" if userinfo else ep


def _check_endpoint(url: str, options: StorageOptions) -> Optional[str]:
    """The endpoint; ArgumentError (the secret not shown) when it holds a user name or password, which
    the S3 client never sends (it signs with the AWS credentials) and every error would print."""
    ep = endpoint(options)
    if ep and _split_userinfo(ep)[1]:
        raise ArgumentError(f"checkpoint {url}: the S3 endpoint {shown_endpoint(options)} holds a user name or "
                            f"password, which is never used: give the endpoint as http(s)://host:port and the "
                            f"credentials as AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or a profile")
    return ep


def credentials_spec(url: str, options: StorageOptions) -> Dict[str, Any]:
    """tensorstore's ``aws_credentials`` for ``options`` and the environment; ArgumentError when
    none are configured (nothing is then sent anywhere)."""
    choice = options.s3_credentials
    if choice is None:
        if os.environ.get("AWS_ACCESS_KEY_ID"):
            choice = "environment"
        elif os.environ.get("AWS_PROFILE"):
            choice = "profile:" + os.environ["AWS_PROFILE"]
        elif os.path.isfile(os.path.expanduser("~/.aws/credentials")):
            choice = "default"
        else:
            raise ArgumentError(
                f"checkpoint {url}: s3:// URLs are not supported without credentials, and none are configured: set "
                f"AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass "
                f"StorageOptions(s3_credentials=...)"
            )
    if choice.startswith("profile:"):
        return {"type": "profile", "profile": choice[len("profile:"):]}
    return {"type": choice}


def kvstore_spec(url: str, options: StorageOptions) -> Dict[str, Any]:
    """The ``s3`` kvstore whose keys are the objects under ``url`` (a directory-like prefix)."""
    loc = parse_s3_url(url)
    spec: Dict[str, Any] = {"driver": "s3", "bucket": loc.bucket, "path": loc.prefix + "/" if loc.prefix else "",
                            "aws_credentials": credentials_spec(url, options)}
    ep = _check_endpoint(url, options)
    if ep:
        spec["endpoint"] = ep
    region = _region(options)
    if region:
        spec["aws_region"] = region
    return spec


def _region(options: StorageOptions) -> Optional[str]:
    region = options.s3_region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    return region or (DEFAULT_REGION if endpoint(options) else None)


def context_spec(options: StorageOptions) -> Dict[str, Any]:
    """tensorstore context resources for S3 requests: concurrency and bounded retries (an
    unreachable endpoint fails after ``s3_retries`` attempts, not after minutes)."""
    return {
        "s3_request_concurrency": {"limit": options.io_concurrency},
        "s3_request_retries": {"max_retries": options.s3_retries, "initial_delay": "100ms", "max_delay": "5s"},
        "data_copy_concurrency": {"limit": options.io_concurrency},
        "cache_pool": {"total_bytes_limit": 0},
    }


def answer_timeout() -> float:
    """Seconds a small S3 request may wait for its answer, retries included: the value of
    ``LIGHTNING_DISTCKPT_S3_TIMEOUT``, else 60 (ArgumentError naming the variable when it is not a
    positive number, so that a typo does not silently keep the default)."""
    return seconds_from_env(S3_TIMEOUT_ENV, DEFAULT_S3_TIMEOUT_S, "an S3 request may wait for its answer")


def list_timeout() -> float:
    """Seconds an object listing may take as a whole: ``LIGHTNING_DISTCKPT_S3_LIST_TIMEOUT``, else 600."""
    return seconds_from_env(S3_LIST_TIMEOUT_ENV, DEFAULT_S3_LIST_TIMEOUT_S, "an S3 object listing may take")


def seconds_from_env(name: str, default: float, what: str) -> float:
    """The positive number of seconds the environment variable ``name`` gives, ``default`` where it is unset
    or blank; an ArgumentError naming it otherwise (a typo must not silently keep the default)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise ArgumentError(f"{name}={text!r}: give the seconds {what}, a positive number")
    return value


def no_answer(options: StorageOptions, seconds: float) -> str:
    """Why a request that got no answer within ``seconds`` failed, in words."""
    return (f"the endpoint {shown_endpoint(options)} did not answer within {seconds:g} s (a stalled "
            f"server, proxy or network; {S3_TIMEOUT_ENV} sets this bound)")


def unended_listing(options: StorageOptions, seconds: float) -> str:
    """Why a listing that did not end within ``seconds`` failed, in words."""
    return (f"the endpoint {shown_endpoint(options)} did not end the listing within {seconds:g} s (a server whose "
            f"pages never end, a stalled one, or a listing too large; {S3_LIST_TIMEOUT_ENV} sets this bound)")


_REDIRECT = re.compile(r"http_response_code=.(3[0-9][0-9])")
_STATUS = re.compile(r"http_response_code='([0-9]{3})'")
_DOC_CODE = re.compile(r"<Code>([A-Za-z0-9.]{1,64})</Code>")  # an S3 error document's code
_EXPECTED_REGION = re.compile(r"expecting '([a-z0-9-]{1,40})'")
# tensorstore's words for where its own read or write of an object (an array chunk, an OCDBT node) failed.
_TS_OBJECT = re.compile(r'Error (reading|writing) (?:Byte range (\[[0-9]+, [0-9]+\)) of )?"([^"]{1,300})"')
# curl's words for a connection never made (everything else failed on a connection the endpoint accepted).
_NO_CONNECTION = ("Could not connect", "Couldn't connect", "resolve", "Connection refused", "Connection timed out")
# What tensorstore says of an answer that is no S3 answer (a web server, a proxy's page at the endpoint).
_NOT_S3 = ("Malformed List response", "etag not found in response headers")
_SET_ENDPOINT = "AWS_ENDPOINT_URL or StorageOptions(s3_endpoint) sets it"
_SET_CREDENTIALS = "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE or StorageOptions(s3_credentials)"


def _curl_failure(detail: str) -> str:
    """What a curl error says of the endpoint, and what to check: unreachable, a TLS handshake that failed,
    stalled mid-answer, or broke off the exchange (an answer cut short, a connection reset): retried, and these
    words after the last attempt."""
    if any(words in detail for words in _NO_CONNECTION):
        return f"is unreachable: is its server running, and is it the right one ({_SET_ENDPOINT})?"
    if "SSL" in detail or "TLS" in detail:
        return ("failed the TLS handshake: does the server speak plain http (then give http://... as the endpoint: "
                f"{_SET_ENDPOINT}), or does its certificate not verify?")
    if "Operation too slow" in detail or "Timeout was reached" in detail:
        return "stalled mid-answer"
    return "broke off its answer"


def _recognized(text: str, options: StorageOptions) -> Optional[str]:
    """Why an S3 request failed, in our words and with what to check, when tensorstore's message ``text`` shows
    a known cause (the cause's quoted detail last); None otherwise."""
    ep = shown_endpoint(options)
    if "NoSuchBucket" in text:
        return f"the bucket does not exist at the endpoint {ep} (check the bucket's name; {_SET_ENDPOINT})"
    if "InvalidAccessKeyId" in text:
        return (f"access denied: the endpoint {ep} knows no such access key (check the AWS credentials: "
                f"{_SET_CREDENTIALS})")
    if "SignatureDoesNotMatch" in text:
        return (f"access denied: the endpoint {ep} refused the request's signature (check the AWS credentials: the "
                f"secret key of {_SET_CREDENTIALS})")
    if "AuthorizationHeaderMalformed" in text or "IllegalLocationConstraint" in text:
        wanted = _EXPECTED_REGION.search(text)
        return (f"the bucket is not in the region {_region(options) or '(none set)'}"
                + (f" but in {wanted.group(1)}" if wanted else "") + ": set AWS_REGION or StorageOptions(s3_region)")
    # a 403 whose error document names another cause (a skewed clock, an archived object's storage class):
    # its own words (the fallback), not "access denied, check the credentials"
    code = _DOC_CODE.search(text)
    other = code is not None and code.group(1) != "AccessDenied"
    if "AccessDenied" in text or ("PERMISSION_DENIED" in text and not other):
        return (f"access denied (check the AWS credentials and what they may do in this bucket and prefix: "
                f"{_SET_CREDENTIALS})")
    if "CURL error" in text:
        detail = text.split("CURL error", 1)[1].split(" [", 1)[0].strip()[:120]
        return f"the endpoint {ep} {_curl_failure(detail)} ({detail})"
    redirect = _REDIRECT.search(text)
    if redirect is not None:  # tensorstore follows none (a bucket in another region: S3's 301)
        return (f"the endpoint {ep} answered with a redirect (HTTP {redirect.group(1)}), which "
                f"is not followed: give the bucket's own endpoint and region (AWS_ENDPOINT_URL, AWS_REGION)")
    status = _STATUS.search(text)
    # a refusal without an error document (a HEAD's answer has none); one with a document says its cause itself
    if status is not None and status.group(1) in ("401", "403") and "<Error>" not in text:
        return (f"access denied (HTTP {status.group(1)}; check the AWS credentials and what they may do in this "
                f"bucket and prefix: {_SET_CREDENTIALS})")
    if any(words in text for words in _NOT_S3) or (
            status is not None and status.group(1).startswith("4") and "<Error>" not in text):
        said = f"HTTP {status.group(1)}" if status is not None else text.split(" [", 1)[0][:120]
        return (f"the endpoint {ep} does not answer as an S3 server ({said}, no S3 error document): is it the S3 "
                f"endpoint, with the right scheme ({_SET_ENDPOINT})?")
    return None


def explain(error: BaseException, options: StorageOptions) -> str:
    """One line saying why an S3 request failed: our words for a known cause (a missing bucket, denied access,
    a wrong region, an unreachable endpoint or one that is no S3 server), else the first line of tensorstore's
    message (the server's XML body left out)."""
    text = str(error)
    said = _recognized(text, options)
    if said is not None:
        return said
    return text.split(" [http_response_body", 1)[0].splitlines()[0][:300] if text else type(error).__name__


def explain_io(error: BaseException, options: StorageOptions, bucket: str) -> str:
    """:func:`explain` of a failure in tensorstore's own reads and writes of a store (array chunks, OCDBT's
    objects), with the object (and byte range) tensorstore names, as a URL; its message as is when the cause
    is not a known one."""
    text = str(error)
    said = _recognized(text, options)
    if said is None:
        return text
    where = _TS_OBJECT.search(text)
    if where is None:
        return said
    verb, span, key = where.groups()
    return f"{said}, {verb} {f'bytes {span} of ' if span else ''}{S3_SCHEME}{bucket}/{key}"
