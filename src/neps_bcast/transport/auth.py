"""Authentication of everything a rank acts on: HMAC-SHA256 with a per-search secret.

Why: the leader's store and the launcher's rendezvous store are plain TCP stores that
anyone who reaches their port can read and write (PyTorch's security policy says so),
and the control channel is a gloo group bootstrapped through them. A rank therefore
acts only on values that carry a valid tag made with the search's secret: a trial's
arguments are unpickled only after their tag checks out, and every control record is
plain JSON besides.

What a tag binds (``Context``, built in one place for the control channel:
``channel_context``): the key (or channel message kind) the value was written for, the
search (``Signer.search``: a nonce the leader draws for each search and each restart,
bound to every follower's own challenge, see ``startup/handshake.py``), the sender's
group rank, and the value's sequence number and group generation. A value recorded
from another key, search, restart, trial, message or generation is refused, even when
the ranks use the same ``NEPS_BCAST_SECRET`` as the one it was recorded under.

Where the secret comes from: ``NEPS_BCAST_SECRET`` when the user sets it (at least 32
random bytes; required for a safe multi-host launch; ``sbatch`` exports it to every
task), turned into the key by a salted, slow derivation; otherwise the leader makes one
per search. Lightning's children inherit it; externally launched ranks on one host read
it from a file only this user can create; ranks on several hosts without a secret fall
back to one passed over the group in the clear, and warn.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import string
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from neps_bcast.errors import AuthError, format_message
from neps_bcast.log import rank_tag

ENV_SECRET = "NEPS_BCAST_SECRET"  # noqa: S105 - a variable name, not a secret
TAG_BYTES = 32
NONCE_BYTES = 32
MIN_SECRET_BYTES = 32
"""The entropy a user secret must carry: 64 hex characters, or 43 of another alphabet."""
MIN_HEX_CHARS = 2 * MIN_SECRET_BYTES
MIN_TEXT_CHARS = 43
"""``secrets.token_urlsafe(32)``: 32 random bytes as 43 characters of base64."""
MIN_DISTINCT_CHARS = 8
"""Fewer distinct characters than this is a pattern, not random text."""
KDF_ITERATIONS = 100_000
_KDF_SALT = b"neps_bcast/NEPS_BCAST_SECRET/v2"
_DOMAIN = b"neps_bcast/tag/v2\0"
_NUMBERS = struct.Struct(">qqq")  # sender, seq, generation
_HEX = frozenset(string.hexdigits)
HINT_NEW_SECRET = (
    f"export {ENV_SECRET}=$(python -c 'import secrets; print(secrets.token_hex(32))')"
    " once, and give every rank the same value"
)


@dataclass(frozen=True)
class Context:
    """What a tag binds besides the value itself and the search."""

    key: str
    """The store key the value is written under, or ``channel/<kind>``."""
    sender: int
    """The group rank of the process that wrote it."""
    seq: int = 0
    """Its sequence number: the trial's (store values of a trial), or the message's
    number on the control channel; 0 where it has none."""
    generation: int = 0
    """The DDP group generation it was sent in; 0 for store values (they belong to no
    group) and before any re-forming."""


def channel_context(kind: str, *, sender: int, seq: int, generation: int) -> Context:
    """The context of one control-channel message (the one place that defines it).

    ``seq`` is the message's number on the channel (every rank counts the channel's
    collectives the same way), ``generation`` the group generation of the sender."""
    return Context(f"channel/{kind}", sender, seq, generation)


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def search_id(nonce: bytes, challenges: Sequence[bytes]) -> bytes:
    """The search's identity: the leader's nonce bound to every rank's challenge."""
    digest = hashlib.sha256(b"neps_bcast/search/v2\0" + nonce)
    for challenge in challenges:
        digest.update(len(challenge).to_bytes(2, "big") + challenge)
    return digest.digest()


def secret_from_env(environ: Mapping[str, str] | None = None, *, tag: str = "") -> bytes | None:
    """The key made from the user's secret, if set; ``AuthError`` if it is too weak."""
    raw = (os.environ if environ is None else environ).get(ENV_SECRET)
    if not raw:
        return None
    check_strength(raw, tag=tag or rank_tag())
    return derive_key(raw)


def check_strength(raw: str, *, tag: str) -> None:
    """Refuse a user secret with less than 32 bytes of entropy (never shows it)."""
    text = raw.strip()
    is_hex = all(c in _HEX for c in text)
    needed = MIN_HEX_CHARS if is_hex else MIN_TEXT_CHARS
    distinct = len(set(text))
    if len(text) >= needed and distinct >= MIN_DISTINCT_CHARS:
        return
    observed = (
        f"{len(text)} {'hex ' if is_hex else ''}characters"
        if len(text) < needed
        else f"only {distinct} distinct characters (a pattern, not random text)"
    )
    raise AuthError(
        format_message(
            tag,
            f"refused {ENV_SECRET}: too weak to protect the search; expected at least"
            f" {MIN_SECRET_BYTES} random bytes ({MIN_HEX_CHARS} hex characters, or"
            f" {MIN_TEXT_CHARS} characters of another alphabet), observed {observed}.",
            f"{HINT_NEW_SECRET}.",
        )
    )


def derive_key(raw: str) -> bytes:
    """The key of a user secret: salted and slow (PBKDF2-HMAC-SHA256), so that even a
    recorded tag does not make guessing the secret cheap."""
    return hashlib.pbkdf2_hmac("sha256", raw.strip().encode(), _KDF_SALT, KDF_ITERATIONS)


def secret_text(secret: bytes) -> str:
    """How a secret travels in an environment variable or a file."""
    return secret.hex()


class Signer:
    """Tags values with the search's secret and checks the tags of what it reads."""

    def __init__(self, secret: bytes, search: bytes = b"") -> None:
        self._key = secret
        self._search = search

    def use(self, secret: bytes, search: bytes | None = None) -> None:
        """Switch to the search's secret (and identity): external launches agree on
        them after meeting."""
        self._key = secret
        if search is not None:
            self._search = search

    @property
    def secret(self) -> bytes:
        return self._key

    @property
    def search(self) -> bytes:
        return self._search

    def _mac(self, context: Context, value: bytes) -> bytes:
        key = context.key.encode()
        mac = hmac.new(self._key, _DOMAIN, hashlib.sha256)
        mac.update(len(self._search).to_bytes(2, "big") + self._search)
        mac.update(len(key).to_bytes(4, "big") + key)
        mac.update(_NUMBERS.pack(context.sender, context.seq, context.generation))
        mac.update(value)
        return mac.digest()

    def sign(self, context: Context, value: bytes) -> bytes:
        """``value`` with its tag in front."""
        return self._mac(context, value) + value

    def verifies(self, context: Context, signed: bytes) -> bool:
        tag, value = signed[:TAG_BYTES], signed[TAG_BYTES:]
        return len(tag) == TAG_BYTES and hmac.compare_digest(tag, self._mac(context, value))

    def open(self, context: Context, signed: bytes) -> bytes:
        """The value if its tag is valid for ``context``; ``AuthError`` otherwise."""
        if self.verifies(context, signed):
            return signed[TAG_BYTES:]
        raise refused(context.key)

    def open_any(self, contexts: Sequence[Context], signed: bytes) -> bytes:
        """The value if its tag is valid for one of ``contexts`` (a key two ranks write)."""
        for context in contexts:
            if self.verifies(context, signed):
                return signed[TAG_BYTES:]
        raise refused(contexts[0].key)


def refused(key: str) -> AuthError:
    return AuthError(
        format_message(
            rank_tag(),
            f"refused the value under {key!r}: it does not carry this search's"
            " authentication tag for that key, sender, sequence and group generation"
            " (nothing in it was used).",
            "another process wrote to neps_bcast's store or channel (a forged value,"
            " or one recorded from another search, restart or trial), or the ranks were"
            f" started with different {ENV_SECRET} values; give every rank the same"
            f" {ENV_SECRET} and keep the store's port private.",
        )
    )
