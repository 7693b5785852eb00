"""API tokens of the job service: random, shown once, stored only as their sha256, with scopes and an expiry.

Scopes are ranked: `admin` may do everything `submit` may, and `submit` everything `read` may. Checking a
token is a pure decision over its record, so the rules are tested without a server."""

from __future__ import annotations

import enum
import hashlib
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from clusterfit.service.store import ApiToken, JobStore, utcnow

SCOPES = ("read", "submit", "admin")  # each includes the ones before it
_TTL = re.compile(r"^(\d+)\s*([smhdw])$")
_TTL_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


class TokenError(ValueError):
    """A one-line user mistake in a token request (bad scope or lifetime)."""


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def parse_ttl(text: str | None) -> timedelta | None:
    """'90s', '15m', '1h', '7d', '2w' -> a timedelta; None or 'never' -> no expiry."""
    if text is None or text.strip().lower() == "never":
        return None
    match = _TTL.match(text.strip().lower())
    if not match or int(match.group(1)) == 0:
        raise TokenError(
            f"--ttl {text!r} is not a lifetime; use a number and a unit, e.g. 90s, 15m, 1h, 7d, 2w, or never"
        )
    try:
        return timedelta(**{_TTL_UNITS[match.group(2)]: int(match.group(1))})
    except OverflowError:
        raise TokenError(f"--ttl {text!r} is longer than any date can hold; use a shorter lifetime, or never") from None


def check_scope(scope: str) -> str:
    if scope not in SCOPES:
        raise TokenError(f"scope {scope!r} is unknown; use one of: {', '.join(SCOPES)}")
    return scope


def grants(held: str, needed: str) -> bool:
    return SCOPES.index(held) >= SCOPES.index(needed)


@dataclass(frozen=True)
class IssuedToken:
    id: int
    name: str
    scope: str
    expires_at: datetime | None
    secret: str  # the token itself: printed once, never stored


def issue_token(store: JobStore, scope: str, ttl: timedelta | None, name: str = "") -> IssuedToken:
    check_scope(scope)
    secret = "cf_" + secrets.token_urlsafe(32)
    record = store.add_token(name or f"{scope}-token", hash_token(secret), [scope], ttl)
    return IssuedToken(record.id, record.name, scope, record.expires_at, secret)


class Verdict(str, enum.Enum):
    ALLOWED = "allowed"
    UNAUTHENTICATED = "unauthenticated"  # HTTP 401: no token, unknown, expired or revoked
    FORBIDDEN = "forbidden"  # HTTP 403: a valid token without the scope


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str
    token: ApiToken | None = None


def decide(record: ApiToken | None, needed: str, now: datetime | None = None) -> Decision:
    """Whether a token's record lets a request that needs scope `needed` through."""
    now = now or utcnow()
    if record is None:
        return Decision(Verdict.UNAUTHENTICATED, "unknown token; create one with `clusterfit token create`")
    if record.revoked_at is not None:
        return Decision(Verdict.UNAUTHENTICATED, f"token {record.name!r} was revoked")
    if record.expires_at is not None and record.expires_at <= now:
        return Decision(
            Verdict.UNAUTHENTICATED, f"token {record.name!r} expired at {record.expires_at:%Y-%m-%d %H:%M} UTC"
        )
    held = [scope for scope in record.scopes.split(",") if scope in SCOPES]
    if not any(grants(scope, needed) for scope in held):
        return Decision(
            Verdict.FORBIDDEN, f"token {record.name!r} has scope {record.scopes!r}; this needs {needed!r}", record
        )
    return Decision(Verdict.ALLOWED, "", record)


def authorize(store: JobStore, bearer: str | None, needed: str) -> Decision:
    if not bearer:
        return Decision(Verdict.UNAUTHENTICATED, "no token; send `Authorization: Bearer <token>`")
    return decide(store.token_by_hash(hash_token(bearer)), needed)
