"""Secrets out of every message: a SAS token in any form it may be pasted or echoed back in, query strings of
URLs, and passwords of database URLs. Torch-free; used wherever text from a store or an SDK reaches a user."""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import parse_qs, quote, quote_plus, unquote

MASK = "***"
# A URL's query string (SAS tokens, signed URLs): everything from "?" to the next space or quote.
_URL_QUERY = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s?'\"<>]*)\?[^\s'\"<>]*")
_URL_PASSWORD = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s:/@'\"]+:)[^\s@'\"]+@")
_NAMED_SECRET = re.compile(
    r"\b(sig|password|passwd|pwd|secret|token|accountkey|sharedaccesssignature)=([^&;\s'\"]+)", re.IGNORECASE
)


def secret_forms(secret: str) -> set[str]:
    """The texts that reveal `secret`: itself, without a leading "?", and for a SAS token its signature value
    as given, URL-decoded and URL-encoded (the signature alone is what grants access, in any parameter order)."""
    bare = secret.strip().lstrip("?")
    forms = {secret, bare}
    for signature in parse_qs(bare).get("sig", []):
        forms |= {signature, quote(signature, safe=""), quote_plus(signature), unquote(signature)}
    return {form for form in forms if len(form) >= 8}  # a short fragment would mask innocent text


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` with every form of `secrets` masked, URL query strings dropped, database and named passwords,
    signatures and keys masked."""
    forms = set().union(*(secret_forms(secret) for secret in secrets if secret))
    for form in sorted(forms, key=len, reverse=True):
        text = text.replace(form, MASK)
    text = _URL_QUERY.sub(rf"\1?{MASK}", text)
    text = _URL_PASSWORD.sub(rf"\1{MASK}@", text)
    return _NAMED_SECRET.sub(rf"\1={MASK}", text)
