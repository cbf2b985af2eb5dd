"""Authentication of everything a rank acts on: HMAC-SHA256 with a per-search secret.

Why: the leader's store and the launcher's rendezvous store are plain TCP stores that
anyone who reaches their port can read and write (PyTorch's security policy says so),
and the control channel is a gloo group bootstrapped through them. A rank therefore
acts only on values that carry a valid tag made with the search's secret: a trial's
arguments are unpickled only after their tag checks out, and every control record is
plain JSON besides. The tag covers the key (or channel) the value was written for, so
a valid value cannot be replayed under another key.

Where the secret comes from: ``NEPS_BCAST_SECRET`` when the user sets it (required
for a safe multi-host launch; ``sbatch`` exports it to every task); otherwise the
leader makes one. Lightning's children inherit it; externally launched ranks on one
host read it from a file only this user can read; ranks on several hosts without a
secret fall back to one passed through the launcher's store, and warn.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping

from neps_bcast.errors import AuthError, format_message
from neps_bcast.log import rank_tag

ENV_SECRET = "NEPS_BCAST_SECRET"  # noqa: S105 - a variable name, not a secret
TAG_BYTES = 32


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def secret_from_env(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The user's secret, if set (any text; hashed to a key)."""
    raw = (os.environ if environ is None else environ).get(ENV_SECRET)
    if not raw:
        return None
    return hashlib.sha256(raw.encode()).digest()


def secret_text(secret: bytes) -> str:
    """How a secret travels in an environment variable or a file."""
    return secret.hex()


class Signer:
    """Tags values with the search's secret and checks the tags of what it reads."""

    def __init__(self, secret: bytes) -> None:
        self._key = secret

    def use(self, secret: bytes) -> None:
        """Switch to the search's secret (external launches agree on it after meeting)."""
        self._key = secret

    @property
    def secret(self) -> bytes:
        return self._key

    def _mac(self, context: str, value: bytes) -> bytes:
        mac = hmac.new(self._key, context.encode() + b"\0", hashlib.sha256)
        mac.update(value)
        return mac.digest()

    def sign(self, context: str, value: bytes) -> bytes:
        """``value`` with its tag in front; ``context`` is the key it is written under."""
        return self._mac(context, value) + value

    def open(self, context: str, signed: bytes) -> bytes:
        """The value if its tag is valid for ``context``; ``AuthError`` otherwise."""
        tag, value = signed[:TAG_BYTES], signed[TAG_BYTES:]
        if len(tag) == TAG_BYTES and hmac.compare_digest(tag, self._mac(context, value)):
            return value
        raise AuthError(
            format_message(
                rank_tag(),
                f"refused the value under {context!r}: it does not carry this search's"
                " authentication tag (nothing in it was used).",
                "another process wrote to neps_bcast's store or channel, or the ranks were"
                f" started with different {ENV_SECRET} values; give every rank the same"
                f" {ENV_SECRET} and keep the store's port private.",
            )
        )

    def check_value(self, context: str) -> str:
        """A text that equals another rank's exactly when both hold the same secret."""
        return self._mac(context, b"").hex()[:16]
