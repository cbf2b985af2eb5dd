"""Another user of this host, attacking a neps_bcast search from before its first rank
starts until after its last one exits.

Started by tests/e2e/test_e2e_attacker.py (and tests/slurm/test_e2e_slurm_attacker.py) as
root with ``--as UID:GID`` (``nobody``): it loads Python and torch as root, so that the
checkout may sit in a folder only root can enter (``mktemp -d`` makes one), then drops to
that uid and gid with no supplementary groups and no capabilities before it reads, plants
or sends anything, and checks that it cannot become root again. Nothing here is neps_bcast code: it speaks the plain TCPStore protocol and
knows neps_bcast's key names the way anyone who reads the source does.

Before the launch it plants:
- a secret file of its own (a readable all-hex file), and a path to it;
- with ``--plant-private-dir``, the directory a one-host launch keeps its secret in;
- a store of its own, full of pickles, and a ``leader`` record that points at it,
  tagged with its own secret.

Then, round after round until ``--stop`` exists (bounded by ``--seconds``), against
every store the test lists in ``--targets`` (the launcher's rendezvous store and the
leader's store, as the test finds them in /proc/net/tcp), it lists every key and:
- records every value of neps_bcast's (``--record``: for a later search);
- writes a pickle that would create ``--marker`` under every key neps_bcast uses, and
  under the keys it will use (the records, the error board, the leader watch, the
  channel's rendezvous, the meeting), and bumps the error counters so that ranks read
  its error records; plants its secret's path, its secret and its ``leader`` record
  under every meeting it sees (what the start-up of earlier releases read);
- with ``--replay``, writes back every value recorded from an earlier search instead
  (the same keys, and the same keys under this search's meeting).

It leaves torch's own keys alone (torch's rendezvous and the gloo groups' ``/pg/`` keys):
torch reads those, not neps_bcast. It reports what it did as JSON on stdout.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import hmac
import json
import os
import pickle
import re
import secrets
import sys
import time
from pathlib import Path

from torch._C._distributed_c10d import TCPStore

MEETING = re.compile(r"^(neps_bcast/meet/[^/]+/[^/]+)/")
WORLD = 2
SEQS = range(1, 6)


class Bomb:
    """Unpickling this creates the marker file: code an outsider chose, run as the user."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.marker, "a"))


def is_ours_to_attack(key: str) -> bool:
    """neps_bcast's keys, not torch's (its rendezvous, and the gloo groups' ``/pg/``)."""
    return key.startswith("neps_bcast/") and "/pg/" not in f"/{key.split('/', 1)[1]}/"


def templates() -> list[str]:
    """The keys neps_bcast will write, written first (before the ranks write them)."""
    keys = ["neps_bcast/leader", "neps_bcast/secret_file", "neps_bcast/secret"]
    for r in range(WORLD):
        keys += [
            f"neps_bcast/rank/{r}",
            f"neps_bcast/watch/released/{r}",
            f"neps_bcast/ctl/joined/{r}",
        ]
    for seq in SEQS:
        keys.append(f"neps_bcast/trial/{seq}")
        keys += [f"neps_bcast/err/{seq}/{r}" for r in range(WORLD)]
    return keys


def drop_to(ids: str) -> dict[str, object]:
    """Become ``UID:GID`` for good, with no groups; what the process is afterwards."""
    uid, gid = (int(x) for x in ids.split(":"))
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    try:
        os.setuid(0)
    except PermissionError:
        regained = False
    else:
        regained = True
    status = Path("/proc/self/status").read_text()
    caps = {
        line.split(":")[0]: int(line.split(":")[1], 16)
        for line in status.splitlines()
        if line.startswith(("CapEff:", "CapPrm:"))
    }
    return {
        "uids": list(os.getresuid()),
        "gids": list(os.getresgid()),
        "groups": os.getgroups(),
        "regained_root": regained,
        "capabilities": caps,
    }


class Outsider:
    def __init__(self, args: argparse.Namespace, became: dict[str, object]) -> None:
        self.args = args
        self.bomb = pickle.dumps(Bomb(args.marker))
        work = Path(args.work)
        self.secret = secrets.token_bytes(32)
        self.secret_file = work / "planted-secret"
        self.secret_file.write_text(self.secret.hex())
        self.secret_file.chmod(0o644)
        (work / "bomb.pickle").write_bytes(self.bomb)  # for the test's positive control
        # Its own store, as a forged leader: every key a rank might read holds a pickle.
        self.own_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        for key in templates():
            self.own_store.set(key, self.bomb)  # type: ignore[arg-type]
        address = f"127.0.0.1:{self.own_store.port}".encode()
        self.forged_leader = (
            hmac.new(hashlib.sha256(self.secret).digest(), b"leader\0" + address, "sha256").digest()
            + address
        )
        self.ours = {self.bomb, self.forged_leader, self.secret.hex().encode()}
        self.ours.add(str(self.secret_file).encode())
        self.stores: dict[str, TCPStore] = {}
        self.recorded: dict[str, list[str]] = {}
        self.replay: dict[str, list[bytes]] = {}
        if args.replay:
            raw = json.loads(Path(args.replay).read_text())
            self.replay = {k: [bytes.fromhex(v) for v in vs] for k, vs in raw.items()}
        self.report: dict[str, object] = {
            "uid": os.getuid(),
            "became": became,
            "rounds": 0,
            "rounds_before_a_target": 0,
            "writes": {},
            "replays": 0,
            "keys_seen": [],
            "unreachable": [],
        }
        self.keys_seen: set[str] = set()
        if args.plant_private_dir:
            self.plant_private_dir(Path(args.plant_private_dir))

    def plant_private_dir(self, path: Path) -> None:
        path.mkdir(mode=0o777)
        path.chmod(0o777)
        (path / "secret-planted").write_text(self.secret.hex())

    def targets(self) -> list[str]:
        try:
            listed = json.loads(Path(self.args.targets).read_text())
        except (OSError, ValueError):
            return []
        return [str(a) for a in listed]

    def reach(self, address: str) -> TCPStore | None:
        if address not in self.stores:
            host, _, port = address.rpartition(":")
            try:
                store = TCPStore(
                    host, int(port), is_master=False, timeout=datetime.timedelta(seconds=3)
                )
                # A key listed a moment ago may be gone (a rank deleted it): a get must
                # not wait for it to come back.
                store.set_timeout(datetime.timedelta(milliseconds=200))
                self.stores[address] = store
            except Exception as exc:
                unreachable = self.report["unreachable"]
                assert isinstance(unreachable, list)
                unreachable.append(f"{address}: {type(exc).__name__}")
                return None
        return self.stores[address]

    def attack(self, address: str, store: TCPStore) -> None:
        writes = self.report["writes"]
        assert isinstance(writes, dict)
        keys = [str(k) for k in store.list_keys()]
        self.keys_seen.update(keys)
        meetings = {m.group(1) for k in keys if (m := MEETING.match(k))}
        if self.args.replay:
            for key, values in self.replay.items():
                for target in self.replayed_keys(key, meetings):
                    for value in values:
                        store.set(target, value)  # type: ignore[arg-type]
                        self.report["replays"] = int(str(self.report["replays"])) + 1
            return
        # Counters (what earlier releases counted error records with) are bumped, not
        # overwritten: an `add` on a value that is not a number drops the connection.
        names = sorted(
            {k for k in keys if is_ours_to_attack(k) and not k.endswith("/n")} | set(templates())
        )
        for meeting in meetings:
            names += [f"{meeting}/in/{r}" for r in range(WORLD)]
            store.set(f"{meeting}/secret_file", str(self.secret_file))
            store.set(f"{meeting}/secret", self.secret.hex())
            store.set(f"{meeting}/leader", self.forged_leader)  # type: ignore[arg-type]
        for name in names:
            self.plant(store, name)
            if name.startswith("neps_bcast/err/"):
                store.add(name.rsplit("/", 1)[0] + "/n", 1)
        writes[address] = int(writes.get(address, 0)) + len(names)

    def plant(self, store: TCPStore, key: str) -> None:
        """Record the genuine value under ``key`` (if any), then put the pickle there,
        atomically (``compare_set``): a genuine value written in between is recorded
        and overwritten next round, never lost to the recording."""
        current = b""
        try:
            if store.check([key]):
                current = store.get(key)
        except Exception:
            current = b""
        self.keep(key, current)
        found = store.compare_set(key, current, self.bomb)  # type: ignore[arg-type]
        self.keep(key, found)

    def keep(self, key: str, value: bytes) -> None:
        if not value or value in self.ours:
            return
        values = self.recorded.setdefault(key, [])
        if value.hex() not in values:
            values.append(value.hex())

    @staticmethod
    def replayed_keys(key: str, meetings: set[str]) -> list[str]:
        """The key itself, and a meeting's key under every meeting of this search."""
        found = MEETING.match(key)
        if found is None:
            return [key]
        rest = key[len(found.group(1)) :]
        return [key] + [meeting + rest for meeting in meetings]

    def run(self) -> None:
        deadline = time.monotonic() + self.args.seconds
        Path(self.args.ready).write_text("ready")
        while not Path(self.args.stop).exists() and time.monotonic() < deadline:
            targets = self.targets()
            if not targets:
                self.report["rounds_before_a_target"] = int(str(self.report["rounds"])) + 1
            for address in targets:
                store = self.reach(address)
                if store is None:
                    continue
                try:
                    self.attack(address, store)
                except Exception:
                    self.stores.pop(address, None)
            self.report["rounds"] = int(str(self.report["rounds"])) + 1
            time.sleep(0.02)  # pacing the attack; bounded by --seconds
        self.report["keys_seen"] = sorted(self.keys_seen)
        if self.args.record:
            Path(self.args.record).write_text(json.dumps(self.recorded))
        self.report["recorded"] = sorted(self.recorded)
        json.dump(self.report, sys.stdout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True, help="a folder of its own")
    parser.add_argument("--targets", required=True, help="JSON list of host:port, re-read")
    parser.add_argument("--marker", required=True)
    parser.add_argument("--ready", required=True, help="written once planted")
    parser.add_argument("--stop", required=True, help="stop when this file exists")
    parser.add_argument("--seconds", type=float, default=400.0)
    parser.add_argument("--record", help="write every neps_bcast value seen here")
    parser.add_argument("--replay", help="replay the values recorded in this file instead")
    parser.add_argument("--plant-private-dir", help="make this directory (0777) first")
    parser.add_argument("--as", dest="ids", required=True, help="UID:GID to drop to at once")
    args = parser.parse_args()
    became = drop_to(args.ids)
    Outsider(args, became).run()


if __name__ == "__main__":
    main()
