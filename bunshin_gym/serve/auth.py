"""Who may use the server: API keys (bearer tokens) from a token file, each with its quotas.

The token file is JSON::

    {"tokens": [{"token": "s3cret", "name": "alice", "max_workspaces": 32, "max_memory": "64G"}]}

``max_workspaces`` counts live workspaces (E2B sandboxes, paused ones excluded, and env
workspaces, clones included); ``max_memory`` bounds the sum of their memory limits. Either
may be omitted (unlimited). A request names its token as E2B does (``X-API-KEY``) or as a
bearer token (``Authorization: Bearer ...``).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from bunshin_gym.config import parse_size
from bunshin_gym.errors import BunshinError

log = logging.getLogger(__name__)


class TokenFileError(BunshinError, ValueError):
    """The token file is missing, unreadable or malformed (the message names the field)."""


@dataclass(frozen=True)
class Principal:
    """One API key and what it may hold at once (0: unlimited)."""

    name: str
    token: str
    max_workspaces: int = 0
    max_memory: int = 0


class TokenStore:
    """The API keys the server accepts, compared in constant time."""

    def __init__(self, principals: list[Principal]):
        if not principals:
            raise TokenFileError("no tokens: the server would accept nobody")
        names = [p.name for p in principals]
        if len(set(names)) != len(names):
            raise TokenFileError(f"token names must be unique, got {names}")
        self.principals = principals

    @classmethod
    def load(cls, path: str | Path) -> TokenStore:
        path = Path(path)
        try:
            doc = json.loads(path.read_text())
        except OSError as e:
            raise TokenFileError(f"token file {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise TokenFileError(f"token file {path}: line {e.lineno} column {e.colno}: {e.msg}") from None
        entries = doc.get("tokens") if isinstance(doc, dict) else None
        if not isinstance(entries, list):
            raise TokenFileError(f"token file {path}: want an object with a list under \"tokens\"")
        out = []
        for i, entry in enumerate(entries):
            where = f"token file {path}: tokens[{i}]"
            if not isinstance(entry, dict) or not isinstance(entry.get("token"), str) or len(entry["token"]) < 8:
                raise TokenFileError(f"{where}: \"token\" must be a string of at least 8 characters")
            unknown = set(entry) - {"token", "name", "max_workspaces", "max_memory"}
            if unknown:
                raise TokenFileError(f"{where}: unknown fields {sorted(unknown)}")
            try:
                max_ws = int(entry.get("max_workspaces") or 0)
                max_mem = parse_size(entry["max_memory"]) if entry.get("max_memory") else 0
            except (TypeError, ValueError) as e:
                raise TokenFileError(f"{where}: {e}") from None
            out.append(Principal(str(entry.get("name") or f"token{i}"), entry["token"], max_ws, max_mem))
        return cls(out)

    @classmethod
    def generated(cls, path: Path) -> TokenStore:
        """One fresh unlimited token, written to ``path`` (mode 0600) for the local user."""
        token = secrets.token_urlsafe(24)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"tokens": [{"token": token, "name": "local"}]}, f)
        log.info("no --token-file: generated one token into %s", path)
        return cls([Principal("local", token)])

    def authenticate(self, token: str | None) -> Principal | None:
        if not token:
            return None
        found = None
        for p in self.principals:  # no early exit: the time taken does not tell which matched
            if hmac.compare_digest(p.token.encode(), token.encode()):
                found = p
        return found


def token_from_headers(headers) -> str | None:
    """The API key of a request: ``X-API-KEY`` (the E2B SDK) or ``Authorization: Bearer``."""
    key = headers.get("x-api-key")
    if key:
        return key
    auth = headers.get("authorization") or ""
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value:
        return value.strip()
    return None
