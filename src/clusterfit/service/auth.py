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
_TTL = re.compile(r"^(\d{1,12})\s*([smhdw])$")  # 12 digits: past MAX_TTL in any unit
_TTL_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
MAX_TTL = timedelta(days=3650)  # a token meant to outlive ten years is one meant to never expire


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
    # NOTE: compared as whole seconds before any timedelta or date is made: either can overflow, and an
    # expiry past the year 9999 cannot be stored.
    seconds = int(match.group(1)) * _TTL_SECONDS[match.group(2)]
    if seconds > MAX_TTL.total_seconds():
        raise TokenError(f"--ttl {text!r} is longer than {MAX_TTL.days} days; use a shorter lifetime, or never")
    return timedelta(seconds=seconds)


def check_scope(scope: str) -> str:
    if scope not in SCOPES:
        raise TokenError(f"scope {scope!r} is unknown; use one of: {', '.join(SCOPES)}")
    return scope


def grants(held: str, needed: str) -> bool:
    return SCOPES.index(held) >= SCOPES.index(needed)


def held_scopes(record: ApiToken) -> list[str]:
    return [scope for scope in record.scopes.split(",") if scope in SCOPES]


def acts_for(record: ApiToken, owner: str) -> bool:
    """Whether a token may change what `owner` submitted: its own owner's jobs, or any job with `admin`."""
    return record.owner == owner or acts_for_everyone(record)


def acts_for_everyone(record: ApiToken) -> bool:
    """An admin token: any owner's jobs, command jobs on any server."""
    return any(grants(scope, "admin") for scope in held_scopes(record))


@dataclass(frozen=True)
class IssuedToken:
    id: int
    name: str
    owner: str
    scope: str
    expires_at: datetime | None
    secret: str  # the token itself: printed once, never stored


def issue_token(store: JobStore, scope: str, ttl: timedelta | None, name: str = "", owner: str = "") -> IssuedToken:
    """A new token; the jobs it submits belong to `owner` (default: its name), and a `submit` token cancels only
    those."""
    check_scope(scope)
    secret = "cf_" + secrets.token_urlsafe(32)
    name = name or f"{scope}-token"
    record = store.add_token(name, hash_token(secret), [scope], ttl, owner=owner or name)
    return IssuedToken(record.id, record.name, record.owner, scope, record.expires_at, secret)


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
    if not any(grants(scope, needed) for scope in held_scopes(record)):
        return Decision(
            Verdict.FORBIDDEN, f"token {record.name!r} has scope {record.scopes!r}; this needs {needed!r}", record
        )
    return Decision(Verdict.ALLOWED, "", record)


def authorize(store: JobStore, bearer: str | None, needed: str) -> Decision:
    if not bearer:
        return Decision(Verdict.UNAUTHENTICATED, "no token; send `Authorization: Bearer <token>`")
    return decide(store.token_by_hash(hash_token(bearer)), needed)
