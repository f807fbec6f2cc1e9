"""Secrets out of anything phalanx shows or stores: a config, a store URL.

One rule everywhere (the dashboard's pages and JSON, `phalanx runs`, the config saved in the run store):
the password of any URL (`postgresql://phalanx:PASSWORD@db/phalanx`), the values of URL query
parameters named like a secret (`?password=...`, `?api_key=...`), and the value of any key named like a
secret (`password`, `secret`, `token`, `api_key`, `access_key`, `credentials`, ...) become "***", and
so does a URL's user part long enough to be a token itself (`https://TOKEN@host`).
Names are split into words on `_`, `-`, `.` and case changes, so `max_tokens` or `tokenizer` are left
alone while `hf_token` and `apiKey` are not.
"""

from __future__ import annotations

import re
from itertools import pairwise
from typing import Any
from urllib.parse import parse_qsl, urlencode

HIDDEN = "***"
SECRET_WORDS = {
    "password",
    "passwd",
    "pwd",
    "secret",
    "secrets",
    "token",
    "credential",
    "credentials",
    "apikey",
    "passphrase",
    "auth",
    "authorization",
    "cookie",
    "dsn",
}
SECRET_PARTS = ("password", "passwd", "secret")  # also inside a word: sslpassword, clientsecret
SECRET_PAIRS = {
    ("api", "key"),
    ("access", "key"),
    ("private", "key"),
    ("secret", "key"),
    ("client", "secret"),
    ("session", "key"),
}
LONGEST_USER_NAME = 32
# scheme://user:password@host/...: the userinfo runs to the authority's last "@" (a password may hold one).
_URL = re.compile(r"\b([a-z][a-z0-9+.\-]*://)([^\s/?#]*@)?([^\s]*)", re.IGNORECASE)


def _words(name: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name)
    return [w for w in re.split(r"[\s_\-.]+", spaced.lower()) if w]


def is_secret_name(name: str) -> bool:
    words = _words(name)
    return any(w in SECRET_WORDS or any(part in w for part in SECRET_PARTS) for w in words) or any(
        pair in SECRET_PAIRS for pair in pairwise(words)
    )


def _redact_one_url(match: re.Match) -> str:
    scheme, userinfo, rest = match.group(1), match.group(2) or "", match.group(3)
    if ":" in userinfo:
        userinfo = userinfo.split(":", 1)[0] + f":{HIDDEN}@"
    elif len(userinfo) > LONGEST_USER_NAME:  # https://TOKEN@host: a user part that long is a credential
        userinfo = f"{HIDDEN}@"
    if "?" in rest:
        head, _, tail = rest.partition("?")
        query, hash_mark, fragment = tail.partition("#")
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(is_secret_name(k) for k, _ in pairs):
            query = urlencode([(k, HIDDEN if is_secret_name(k) else v) for k, v in pairs], safe="*")
        rest = f"{head}?{query}{hash_mark}{fragment}"
    return scheme + userinfo + rest


def redact_text(text: str) -> str:
    """`text` with the credentials of every URL in it hidden."""
    return _URL.sub(_redact_one_url, text) if "://" in text else text


def redact_url(url: str) -> str:
    """One URL (a store's) for messages, its password hidden."""
    return redact_text(url)


def redact(value: Any) -> Any:
    """A copy of a config (dicts, lists, strings, numbers) with every secret hidden."""
    if isinstance(value, dict):
        return {
            k: (HIDDEN if isinstance(k, str) and is_secret_name(k) and v not in (None, "") else redact(v))
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value
