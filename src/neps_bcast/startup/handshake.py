"""How the ranks of a group agree on the search's secret and identity, over the group.

Runs on every rank before trial 1, over a group of all the ranks (``ranks``: one of
neps_bcast's own for the handshake only, or the user's). Everything travels over the
group's own connections, as plain bytes in tensors (never a pickle); nothing is read
from a store, where anyone who reaches the port can write.

1. **Records.** Every rank gathers every rank's record: pid, host, the fingerprint of
   its ``neps_bcast.run`` arguments, whether ``NEPS_BCAST_SECRET`` is set, a fresh
   random challenge, and what it refused already (a weak ``NEPS_BCAST_SECRET``). Ranks
   with different arguments fail on every rank, each rank's value listed
   (``rendezvous.compare``).
2. **The leader's record.** The leader draws a nonce (each search and each restart
   draws its own) and broadcasts its store's address, the nonce and every rank's
   challenge, tagged with the secret. The search's identity is the nonce bound to the
   challenges (``auth.search_id``); every later tag binds it. The secret is
   ``NEPS_BCAST_SECRET`` where set; otherwise, every rank on this host, one the leader
   makes and leaves in a file only this user can create, at a path derived from the run
   (``transport/private.py``); otherwise (several hosts) the broadcast carries it in the
   clear and every rank warns.
3. **Answers.** Every follower checks the record's tag and finds its own challenge in
   it (an old record cannot be replayed), then every rank gathers every rank's answer:
   a proof that it holds this search's key (an HMAC of the search's identity: nothing
   that helps to guess the secret), or what it refused. Unless every rank proved it,
   every rank raises the same error, naming each rank's refusal and its fix.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
from collections.abc import Callable
from typing import Any

from neps_bcast.errors import AuthError, LaunchError, format_message
from neps_bcast.log import logger, role_tag
from neps_bcast.startup import ranks, rendezvous
from neps_bcast.startup.launch import Launch
from neps_bcast.startup.ranks import Ranks, broadcast, gather
from neps_bcast.transport import auth, private
from neps_bcast.transport.auth import ENV_SECRET, Context, Signer
from neps_bcast.transport.link import Link

LEADER_KEY = "neps_bcast/leader"
PROOF_KEY = "neps_bcast/proof"
FILE_HINT = (
    "only this user's processes can write this file; if you did not expect one, check"
    " who can write its directory, or set NEPS_BCAST_SECRET on every rank (then no file"
    " is used)."
)


def secret_file_name(launch: Launch) -> str:
    """The secret's file name: derived from the run (never read from a store)."""
    identity = json.dumps([launch.launcher, *launch.identity]).encode()
    return f"secret-{hashlib.sha256(identity).hexdigest()[:32]}"


def hand_over(
    launch: Launch,
    link: Link,
    signer: Signer,
    fingerprint: dict[str, str],
    *,
    user_secret: bytes | None,
    refusal: str | None,
    address: Callable[[int], str],
    group: Ranks,
) -> None:
    """The whole handshake (see the module docstring); on success the leader serves its
    store and every follower is connected to it, with ``signer`` set to the search's key
    and identity. ``refusal``: what this rank refused before (its error's text)."""
    _Handshake(launch, link, signer, user_secret, group).run(fingerprint, refusal, address)


class _Handshake:
    def __init__(
        self,
        launch: Launch,
        link: Link,
        signer: Signer,
        user_secret: bytes | None,
        group: Ranks,
    ) -> None:
        self.launch = launch
        self.rank = launch.global_rank
        self.link = link
        self.signer = signer
        self.user_secret = user_secret
        self.group = group
        self.tag = role_tag(self.rank, group.world_size)
        self.challenge = secrets.token_bytes(16)
        self.file_name = secret_file_name(launch)
        self.is_single_host = True

    def _gather(self, value: dict[str, Any], what: str) -> list[dict[str, Any]]:
        raw = gather(self.group, json.dumps(value).encode(), self.tag)
        return [ranks.record(r, what, self.tag) for r in raw]

    def run(
        self, fingerprint: dict[str, str], refusal: str | None, address: Callable[[int], str]
    ) -> None:
        records = self._gather(
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "fingerprint": {
                    **fingerprint,
                    ENV_SECRET: "set" if os.environ.get(ENV_SECRET) else "not set",
                },
                "challenge": self.challenge.hex(),
                "refused": refusal,
            },
            "a rank's startup record",
        )
        _raise_refusals(self.tag, {r: rec.get("refused") for r, rec in enumerate(records)})
        rendezvous.compare(self.tag, [dict(rec.get("fingerprint") or {}) for rec in records])
        self._decide_hosts([str(rec.get("host")) for rec in records])
        secret_dir: private.PrivateDir | None = None
        leader_address = ""
        try:
            if self.rank == 0:
                secret_dir, problem = self._lead(_challenges(records), address)
            else:
                leader_address, problem = self._follow()
            proof = self.signer.sign(Context(PROOF_KEY, self.rank), b"") if problem is None else b""
            answers = self._gather({"refused": problem, "proof": proof.hex()}, "a rank's answer")
        finally:
            if secret_dir is not None:  # every rank has read it (or never will)
                secret_dir.remove(self.file_name)
                secret_dir.close()
        refused: dict[int, str | None] = {}
        for r, answer in enumerate(answers):
            text = answer.get("refused")
            if text is None and problem is None and not self._proves(r, answer.get("proof")):
                text = (
                    "its proof of this search's key does not check out; expected rank"
                    f" {r} to hold the same {ENV_SECRET} as this rank"
                )
            refused[r] = None if text is None else str(text)
        _raise_refusals(self.tag, refused)
        if self.rank != 0:
            self.link.connect(leader_address)

    def _decide_hosts(self, hosts: list[str]) -> None:
        """Every rank on this host (the secret goes through a private file), or not."""
        self.is_single_host = len(set(hosts)) == 1
        if self.launch.is_single_node and not self.is_single_host:
            each = ", ".join(f"rank {r}: {h}" for r, h in enumerate(hosts))
            raise LaunchError(
                format_message(
                    self.tag,
                    "the launcher's variables put every rank on this node, but the ranks"
                    f" report different hosts ({each}).",
                    "check the launch (LOCAL_WORLD_SIZE, SLURM_NNODES, MASTER_ADDR); if it"
                    " is right, another process is tampering with the group's connections.",
                )
            )
        self.link.loopback = self.is_single_host
        if self.user_secret is None and not self.is_single_host:
            _warn_clear_secret(len(set(hosts)))

    def _proves(self, rank: int, proof: object) -> bool:
        try:
            signed = bytes.fromhex(str(proof))
        except ValueError:
            return False
        return self.signer.verifies(Context(PROOF_KEY, rank), signed)

    def _lead(
        self, challenges: list[bytes], address: Callable[[int], str]
    ) -> tuple[private.PrivateDir | None, str | None]:
        """The leader's side of step 2: it always broadcasts, even what went wrong."""
        secret = self.user_secret or auth.new_secret()
        nonce = auth.new_nonce()
        secret_dir = None
        problem = None
        payload: dict[str, Any] = {}
        try:
            if self.user_secret is None and self.is_single_host:
                secret_dir = private.open_dir(
                    private.private_dir(), create=True, label="the private directory"
                )
                secret_dir.write(self.file_name, auth.secret_text(secret).encode())
            elif self.user_secret is None:
                payload["secret"] = auth.secret_text(secret)  # several hosts: warned
            self.signer.use(secret, auth.search_id(nonce, challenges))
            record = {
                # A store on loopback only (every rank on this host) is reached there,
                # whatever address routes to MASTER_ADDR (torchrun --local-addr).
                "address": (
                    f"127.0.0.1:{self.link.serve().port}"
                    if self.link.loopback
                    else address(self.link.serve().port)
                ),
                "nonce": nonce.hex(),
                "challenges": [c.hex() for c in challenges],
            }
            signed = Signer(secret).sign(Context(LEADER_KEY, 0), json.dumps(record).encode())
            payload["record"] = signed.hex()
        except Exception as exc:  # noqa: BLE001 - told to every rank, which all stop
            problem = message_of(exc)
            payload = {"refused": problem}
        broadcast(self.group, json.dumps(payload).encode(), self.tag)
        return secret_dir, problem

    def _follow(self) -> tuple[str, str | None]:
        """A follower's side of step 2: the leader's address, or what it refused."""
        payload = ranks.record(
            broadcast(self.group, None, self.tag), "the leader's record", self.tag
        )
        if payload.get("refused") is not None:
            return "", "the leader could not start the search (see rank 0's refusal)"
        try:
            secret = self._secret(payload)
            raw = Signer(secret).open(
                Context(LEADER_KEY, 0), bytes.fromhex(str(payload.get("record")))
            )
            record = json.loads(raw.decode())
            challenges = [bytes.fromhex(c) for c in record["challenges"]]
            if self.rank >= len(challenges) or challenges[self.rank] != self.challenge:
                raise _replayed(self.tag)
            self.signer.use(secret, auth.search_id(bytes.fromhex(record["nonce"]), challenges))
            return str(record["address"]), None
        except AuthError as exc:
            return "", message_of(exc)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return "", message_of(_replayed(self.tag))
        except Exception as exc:  # noqa: BLE001 - told to every rank, which all stop
            return "", f"{type(exc).__name__}: {message_of(exc)}"

    def _secret(self, payload: dict[str, Any]) -> bytes:
        if self.user_secret is not None:
            return self.user_secret
        if self.is_single_host:
            with private.opened(
                private.private_dir(), create=False, label="the private directory"
            ) as folder:
                text = folder.read(self.file_name, hint=FILE_HINT, label="the secret's file")
            return bytes.fromhex(text.decode())
        return bytes.fromhex(str(payload.get("secret")))


def _challenges(records: list[dict[str, Any]]) -> list[bytes]:
    try:
        return [bytes.fromhex(str(rec.get("challenge"))) for rec in records]
    except ValueError:
        return []


def _replayed(tag: str) -> AuthError:
    return AuthError(
        format_message(
            tag,
            f"refused the leader's record {LEADER_KEY!r}: it does not hold this rank's"
            " challenge of this start (a record of another search or restart, or not a"
            " record at all; nothing in it was used).",
            "another process is tampering with the group's connections; keep the"
            " rendezvous port private.",
        )
    )


def message_of(exc: BaseException) -> str:
    """An error's text without its ``[tag] `` (it is quoted on every rank)."""
    text = str(exc)
    return text.split("] ", 1)[1] if text.startswith("[") and "] " in text else text


def _quoted(text: str) -> str:
    """Another error's text inside this one: its HINT becomes a "fix" in parentheses."""
    what, sep, hint = text.partition(" HINT: ")
    return f"{what.rstrip('.')} (fix: {hint.rstrip('.')})" if sep else what.rstrip(".")


def _raise_refusals(tag: str, refused: dict[int, str | None]) -> None:
    bad = {r: text for r, text in refused.items() if text}
    if not bad:
        return
    each = " ".join(f"rank {r}: {_quoted(text)}." for r, text in sorted(bad.items()))
    raise AuthError(
        format_message(
            tag,
            f"stopping before trial 1 on every rank: {len(bad)} of {len(refused)} ranks"
            f" refused a value this search would have trusted. {each}",
            "fix what each rank refused (as its fix says) and start the search again.",
        )
    )


def _warn_clear_secret(hosts: int) -> None:
    logger.warning(
        "this group spans %d hosts and %s is not set: the control store and channel"
        " are authenticated with a secret that the leader sent over the group's"
        " connections in the clear, so anyone who can read or tamper with that traffic"
        " can drive the ranks. HINT: export %s=<64 random hex characters> to every rank"
        " (sbatch exports it to every task).",
        hosts,
        ENV_SECRET,
        ENV_SECRET,
    )
