"""Which addresses are this machine's own (loopback), decided by parsing them, never by their first characters:
`127.evil.example` is a name anyone can point anywhere. Shared by the server (what it may bind without TLS or
without tokens, which Host and Origin it answers) and the client (where it may send a token over plain HTTP)."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit


def is_loopback(host: str | None) -> bool:
    """An address or `localhost`; any other name is not loopback, whatever it resolves to today."""
    if not host:
        return False
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def url_host(url: str) -> str | None:
    """The host of a URL or of an HTTP Host header (`127.0.0.1:8080`, `[::1]:8080`), without brackets or port;
    None for an empty value."""
    return urlsplit(url if "//" in url else f"//{url}").hostname
