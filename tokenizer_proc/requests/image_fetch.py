"""An image reference of a request -> its encoded bytes (or ApiError 400 naming the reference's field).

Rules:
- a reference is a `data:image/<type>;base64,<data>` URL, an `http://` / `https://` URL, or (SGLang's
  `image_data` only: `ImageRef.raw_ok`) bare base64; any other scheme (file, ftp, ...) is a 400, so the
  server never reads its own files for a client;
- a URL is fetched by this process (httpx, redirects followed) within `--media-fetch-timeout` seconds
  for the whole body, and a non-2xx answer is a 400 naming its status; with `--allowed-media-domains`
  the URL and every redirect must name one of those hosts (else a 400 before anything is sent there:
  the server fetches no address a client could not reach through those hosts);
- no image holds more than `--max-image-bytes` encoded bytes: base64 is measured before it is decoded,
  a fetched body while it streams (a declared Content-Length over the limit stops it before its body);
- fetching happens before a response starts, so every failure is a 4xx with a JSON body.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import re
from dataclasses import dataclass

import httpx

from tokenizer_proc.http.errors import ApiError, bad_request

logger = logging.getLogger(__name__)

_DATA_URL = re.compile(r"data:([^,;]*)((?:;[^,;]*)*),", re.IGNORECASE)
_SCHEME = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*):")
MAX_REDIRECTS = 5


@dataclass(frozen=True)
class ImageRef:
    """One image of a request as the client gave it: `source` (a URL or base64) and the request field it
    sits in (`param`, named by every error about it). `raw_ok`: bare base64 is accepted too."""

    source: str
    param: str
    raw_ok: bool = False


@dataclass(frozen=True)
class FetchLimits:
    timeout_s: float
    max_bytes: int
    domains: frozenset[str] = frozenset()  # the hosts URLs may name (empty: any)


class _HostRefused(Exception):
    """A URL (or a redirect) names a host outside --allowed-media-domains."""


def _b64_size(data: str) -> int:
    """The decoded size of base64 text (an upper bound when it holds whitespace)."""
    return len(data) * 3 // 4


def decode_base64(data: str, ref: ImageRef, limits: FetchLimits) -> bytes:
    """The bytes of base64 text (standard or URL-safe alphabet), refused above the byte limit before decoding."""
    if _b64_size(data.strip()) > limits.max_bytes + 3:
        raise too_large(ref, limits, f"about {_b64_size(data)} bytes")
    text = "".join(data.split())
    try:
        raw = base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_" if "-" in text or "_" in text else None,
                               validate=True)  # fmt: skip
    except (binascii.Error, ValueError):
        raise bad_request("image is not valid base64", ref.param) from None
    if len(raw) > limits.max_bytes:
        raise too_large(ref, limits, f"{len(raw)} bytes")
    if not raw:
        raise bad_request("image is empty", ref.param)
    return raw


def too_large(ref: ImageRef, limits: FetchLimits, size: str) -> ApiError:
    return bad_request(f"image is larger than the limit of {limits.max_bytes} bytes ({size}; --max-image-bytes)",
                       ref.param)


def _data_url(source: str, ref: ImageRef, limits: FetchLimits) -> bytes:
    m = _DATA_URL.match(source)
    if m is None:
        raise bad_request("a data URL must be data:image/<type>;base64,<data>", ref.param)
    mime, params = m.group(1).strip().lower(), m.group(2).lower()
    if mime and not mime.startswith("image/"):
        raise bad_request(f"a data URL of type {mime!r} is not an image (data:image/<type>;base64,...)", ref.param)
    if ";base64" not in params:
        raise bad_request("a data URL image must be base64 (data:image/<type>;base64,...)", ref.param)
    return decode_base64(source[m.end():], ref, limits)


class Fetcher:
    """Fetches image references. Owns one httpx client per event loop it was used from (made on first use)."""

    def __init__(self, limits: FetchLimits):
        self.limits = limits
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            timeout = httpx.Timeout(self.limits.timeout_s)
            self._client = httpx.AsyncClient(timeout=timeout, follow_redirects=True, max_redirects=MAX_REDIRECTS,
                                             event_hooks={"request": [self._check_host]})  # fmt: skip
            self._loop = loop
        return self._client

    async def fetch(self, ref: ImageRef) -> bytes:
        """The encoded bytes of one reference (module doc), or ApiError 400 naming `ref.param`."""
        source = ref.source.strip()
        if source[:5].lower() == "data:":
            return _data_url(source, ref, self.limits)
        scheme = _SCHEME.match(source)
        if scheme is not None and scheme.group(1).lower() in ("http", "https"):
            return await self._fetch_url(source, ref)
        if ref.raw_ok and scheme is None:
            return decode_base64(source, ref, self.limits)
        kind = f"scheme {scheme.group(1)!r}" if scheme is not None else "reference"
        allowed = "data:image/...;base64, http:// or https:// URLs" + (" or base64" if ref.raw_ok else "")
        raise bad_request(f"image {kind} is not supported ({allowed})", ref.param)

    async def _check_host(self, request: httpx.Request) -> None:
        host = (request.url.host or "").lower()
        if self.limits.domains and host not in self.limits.domains:
            raise _HostRefused(host)

    async def _fetch_url(self, url: str, ref: ImageRef) -> bytes:
        timeout = self.limits.timeout_s
        try:
            return await asyncio.wait_for(self._get(url, ref), timeout)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            raise bad_request(f"image URL did not deliver its image within {timeout:g} s (--media-fetch-timeout)",
                              ref.param) from None
        except _HostRefused as e:
            raise bad_request(f"image URL host {e.args[0]!r} is not one of --allowed-media-domains",
                              ref.param) from None

    async def _get(self, url: str, ref: ImageRef) -> bytes:
        limit = self.limits.max_bytes
        try:
            async with self._http().stream("GET", url) as resp:
                if not 200 <= resp.status_code < 300:
                    raise bad_request(f"image URL answered HTTP {resp.status_code}", ref.param)
                declared = resp.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > limit:
                    raise too_large(ref, self.limits, f"Content-Length {declared}")
                body = bytearray()
                async for chunk in resp.aiter_bytes():
                    body += chunk
                    if len(body) > limit:
                        raise too_large(ref, self.limits, f"more than {limit} bytes sent")
                return bytes(body)
        except (httpx.HTTPError, httpx.InvalidURL) as e:
            raise bad_request(f"image URL cannot be fetched: {type(e).__name__}: {e}", ref.param) from None
