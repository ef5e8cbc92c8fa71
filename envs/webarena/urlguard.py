"""Where the browser may go: the origin of a URL, one definition for both sides.

Imported by the controller (``bunshin_gym.envs.webarena.actions``, which refuses ``goto``
URLs outside the env's sites) and by the in-workspace driver (``driver.py``, which checks
every URL again and aborts requests elsewhere); the env writes this file next to the
driver, so it needs nothing but the standard library.
"""

from __future__ import annotations

from urllib.parse import urlsplit


def origin(url: str) -> str | None:
    """``scheme://host:port`` of an http(s) URL (default port written out), else None.

    URLs that browsers and ``urllib`` may read differently (a backslash, a space or control
    character, credentials before the host) have no origin here: they are refused."""
    if any(c in url for c in "\\\t\n\r ") or any(ord(c) < 32 for c in url):
        return None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname or "@" in parts.netloc:
        return None
    scheme = parts.scheme.lower()
    return f"{scheme}://{parts.hostname.lower()}:{port or (443 if scheme == 'https' else 80)}"
