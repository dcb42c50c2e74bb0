"""Credentials in URLs, taken out of every text that is written or printed (issue 22, item 5).

A careless user puts the key and secret into a mount URL (``s3://KEY:SECRET@bucket/run``) or a signed
query string (``?X-Amz-Security-Token=...``). :func:`split_userinfo` takes the userinfo apart (the
mount's credentials, given to fsspec as storage options by :func:`ckpt.storage.locate`), and
:func:`redact` removes every credential from a text — one URL or a whole message that mentions
URLs anywhere — so it may be written (config.json, manifests, the catalog, metrics) or printed
(errors, log records, warnings, CLI lines)::

    redact("copying to 's3://AKIA..:se/cret@b/r?X-Amz-Signature=ab' failed")
        == "copying to 's3://b/r?X-Amz-Signature=REDACTED' failed"

Userinfo is what lies between ``://`` and the first ``@`` when it starts with a key holding none of
``/``, ``:`` and ``@`` (then optionally ``:`` and a secret up to that ``@``: AWS secrets hold ``/``
and ``+``, so the secret is not cut at a ``/``); an ``@`` after a path's ``/`` (``s3://b/run@v2``)
is not userinfo. Every query value is replaced by ``REDACTED`` (the names stay, to say what was
there). The functions are idempotent and leave text without URLs as it is.
"""

from __future__ import annotations

import re

__all__ = ["redact", "split_userinfo", "REDACTED"]

REDACTED = "REDACTED"
_SCHEME = r"[A-Za-z][A-Za-z0-9+.-]*://"
_USERINFO = re.compile(r"(" + _SCHEME + r")([^/:@\s'\"<>]+)(?::([^@\s'\"<>]*))?@")
_QUERY = re.compile(r"(" + _SCHEME + r"[^\s'\"<>?]*)\?([^\s'\"<>#]*)")
_PAIR = re.compile(r"([^&=]*)(=)?([^&]*)")


def split_userinfo(url: str) -> tuple[str, str | None, str | None]:
    """``(url without userinfo, key, secret)``; key and secret None when the URL holds none."""
    found = _USERINFO.match(url)
    if found is None:
        return url, None, None
    return found.group(1) + url[found.end():], found.group(2), found.group(3)


def _query(found: re.Match) -> str:
    pairs = []
    for item in found.group(2).split("&"):
        name, eq, value = _PAIR.fullmatch(item).groups()
        pairs.append(f"{name}={REDACTED}" if eq or value else name)
    return f"{found.group(1)}?{'&'.join(pairs)}"


def redact(text) -> str:
    """``text`` (any object: its ``str``) with every URL's userinfo removed and its query values
    replaced (see the module docstring)."""
    text = str(text)
    if "://" not in text:
        return text
    text = _USERINFO.sub(lambda m: m.group(1), text)
    return _QUERY.sub(_query, text)
