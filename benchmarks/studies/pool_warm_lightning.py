"""Can a warm process run Lightning / Fabric DDP trials of different group sizes one after another?

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python benchmarks/studies/pool_warm_lightning.py \
        [--env elastic|plain] [--form visible|pinned]

Why: a pool of warm ranks (issue 22) would hand one process trial A as rank 1 of 2, then
trial B as rank 3 of 4. This starts 4 warm processes (Lightning imported, blocked on a pipe)
and runs a schedule of trials, some side by side, each a real `Trainer(strategy="ddp",
accelerator="cpu", devices=k).fit` or `Fabric(strategy="ddp", devices=k).launch()`.

Between trials a worker does exactly this, and nothing else:
1. removes every launcher variable (LAUNCHER_VARS) and sets the new trial's;
2. after the trial, `torch.distributed.destroy_process_group()`.

--env elastic (default): torchrun's variables; the parent hosts each trial's TCPStore on a
port the OS picks and the ranks join it as clients (TORCHELASTIC_USE_AGENT_STORE=True, as
under torchrun): no rank binds a port. --env plain: only MASTER_ADDR/MASTER_PORT/LOCAL_RANK/
NODE_RANK/WORLD_SIZE (Lightning's own environment); group rank 0 binds MASTER_PORT, which
the parent found free just before (a race another process could win).

--form visible (default): `devices=k`, LOCAL_RANK = group rank, as when every rank sees all
devices (on GPUs: `devices=[the group's device indexes]`, and rank r takes the r-th).
--form pinned: `devices=1, num_nodes=k`, LOCAL_RANK=0 and NODE_RANK/GROUP_RANK = group rank,
as for a process that sees only its own device (CUDA_VISIBLE_DEVICES set once at its start).

Each trial checks, on every rank: the Trainer's/Fabric's world size and rank, the cluster
environment Lightning detected, torch.distributed's group size, that the ranks ended with
identical weights (DDP synchronised them), and which os.environ keys Lightning changed.
A negative control shows that a stale environment is refused. Prints one line per rank and
trial, then a verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
LAUNCHER_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
)

# (api, groups of warm-process indexes run side by side). Process 3 is rank 1 of 2 in the
# first trial and rank 3 of 4 in the second, then alone, for each API; then both APIs at once.
SCHEDULE: list[tuple[str, list[list[int]]]] = [
    ("trainer", [[0, 1], [2, 3]]),
    ("trainer", [[0, 1, 2, 3]]),
    ("trainer", [[3], [2, 0, 1]]),
    ("fabric", [[0, 1], [2, 3]]),
    ("fabric", [[0, 1, 2, 3]]),
    ("fabric", [[3], [2, 0, 1]]),
    ("trainer", [[1, 3]]),
]


# ----------------------------------------------------------------------------------------
# Worker side.


def _weights_digest(module: Any) -> float:
    return float(sum(p.detach().double().sum() for p in module.parameters()))


def run_trainer(
    world: int, seed: int | None, pinned: bool, timeout_s: float | None = None
) -> dict[str, Any]:
    from datetime import timedelta

    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    if seed is not None:
        L.seed_everything(seed, verbose=False)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    model = Model()
    trainer = L.Trainer(
        accelerator="cpu",
        strategy="ddp" if timeout_s is None else DDPStrategy(timeout=timedelta(seconds=timeout_s)),
        devices=1 if pinned else world,
        num_nodes=world if pinned else 1,
        max_epochs=1,
        limit_train_batches=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=4))
    return {
        "env_class": type(trainer.strategy.cluster_environment).__name__,
        "lightning_world": trainer.world_size,
        "lightning_rank": trainer.global_rank,
        "digest": _weights_digest(model),
    }


def run_fabric(world: int, seed: int | None, pinned: bool) -> dict[str, Any]:
    import torch
    from lightning.fabric import Fabric

    fabric = Fabric(
        accelerator="cpu",
        strategy="ddp",
        devices=1 if pinned else world,
        num_nodes=world if pinned else 1,
    )
    fabric.launch()
    if seed is not None:
        fabric.seed_everything(seed)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    for _ in range(4):
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return {
        "env_class": type(fabric.strategy.cluster_environment).__name__,  # type: ignore[attr-defined]
        "lightning_world": fabric.world_size,
        "lightning_rank": fabric.global_rank,
        "digest": _weights_digest(model),
    }


def worker(index: int) -> None:
    import lightning  # noqa: F401  (warm: imported before the first trial)
    import torch
    import torch.distributed as dist
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    sys.stdout.write(json.dumps({"ready": index}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:  # blocked between trials
        order = json.loads(line)
        if order["kind"] == "quit":
            break
        for name in LAUNCHER_VARS:  # step 1: the previous trial's launcher variables out
            os.environ.pop(name, None)
        os.environ.update(order["env"])
        before = dict(os.environ)
        result: dict[str, Any] = {"index": index, "trial": order["trial"], "api": order["api"]}
        try:
            if order["api"] == "trainer":
                trained = run_trainer(
                    order["world"], order.get("seed"), order["pinned"], order.get("timeout_s")
                )
            else:
                trained = run_fabric(order["world"], order.get("seed"), order["pinned"])
            result.update(trained)
            result["torch_world"] = dist.get_world_size()
            result["torch_rank"] = dist.get_rank()
            result["rank_zero_only.rank"] = rank_zero_only.rank
            digests = [None] * dist.get_world_size()
            dist.all_gather_object(digests, result["digest"])
            result["ranks_agree"] = len(set(digests)) == 1
            result["cuda_initialized"] = torch.cuda.is_initialized()
        except Exception as error:
            result["error"] = f"{type(error).__name__}: {error}"
        after = dict(os.environ)
        result["env_changed"] = sorted(
            k for k in set(before) | set(after) if before.get(k) != after.get(k)
        )
        result["env_left"] = {k: after[k] for k in ("PL_GLOBAL_SEED",) if k in after}
        if dist.is_initialized():  # step 2: the trial's group away
            dist.destroy_process_group()
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


# ----------------------------------------------------------------------------------------
# Parent side.


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def launcher_env(
    mode: str, pinned: bool, port: int, trial: str, world: int, rank: int
) -> dict[str, str]:
    # pinned: each rank is a "node" of one device (what torchrun sets for --nnodes k
    # --nproc-per-node 1); visible: one node of k local ranks.
    local_rank, node_rank = (0, rank) if pinned else (rank, 0)
    env = {
        "MASTER_ADDR": HOST,
        "MASTER_PORT": str(port),
        "LOCAL_RANK": str(local_rank),
        "NODE_RANK": str(node_rank),
        "WORLD_SIZE": str(world),
    }
    if mode == "elastic":  # what torchrun sets for its workers
        env |= {
            "RANK": str(rank),
            "LOCAL_WORLD_SIZE": "1" if pinned else str(world),
            "GROUP_RANK": str(node_rank),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world),
            "GROUP_WORLD_SIZE": str(world) if pinned else "1",
            "TORCHELASTIC_RUN_ID": trial,
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", choices=["elastic", "plain"], default="elastic")
    parser.add_argument("--form", choices=["visible", "pinned"], default="visible")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return

    import torch.distributed as dist

    pinned = args.form == "pinned"
    print(
        f"# warm Lightning/Fabric trials, --env {args.env} --form {args.form}, "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}"
    )
    print(f"load: {Path('/proc/loadavg').read_text().strip()}")
    workers = [
        subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", str(i)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]

    def send(i: int, order: dict[str, Any]) -> None:
        stdin = workers[i].stdin
        assert stdin is not None
        stdin.write(json.dumps(order) + "\n")
        stdin.flush()

    def receive(i: int) -> dict[str, Any]:
        stdout = workers[i].stdout
        assert stdout is not None
        line = stdout.readline()
        if not line:
            raise RuntimeError(f"worker {i} exited")
        answer: dict[str, Any] = json.loads(line)
        return answer

    failures = 0
    history: dict[int, list[str]] = {i: [] for i in range(4)}
    try:
        for i in range(4):
            receive(i)
        for number, (api, groups) in enumerate(SCHEDULE):
            stores = []
            t0 = time.monotonic()
            for group_number, members in enumerate(groups):
                trial = f"trial{number}.{group_number}"
                if args.env == "elastic":
                    store = dist.TCPStore(HOST, 0, None, is_master=True, wait_for_workers=False)
                    stores.append(store)
                    port = store.port
                else:
                    port = free_port()
                for rank, i in enumerate(members):
                    env = launcher_env(args.env, pinned, port, trial, len(members), rank)
                    seed = 1000 + number if number == 0 else None  # only the first trial seeds
                    order = {"kind": "trial", "trial": trial, "api": api, "env": env}
                    send(i, order | {"world": len(members), "seed": seed, "pinned": pinned})
            for members in groups:
                for rank, i in enumerate(members):
                    result = receive(i)
                    ok = (
                        "error" not in result
                        and result["lightning_world"] == result["torch_world"] == len(members)
                        and result["lightning_rank"] == result["torch_rank"] == rank
                        and result["rank_zero_only.rank"] == rank
                        and result["ranks_agree"]
                    )
                    failures += not ok
                    history[i].append(f"{api} {rank}/{len(members)}")
                    print(("ok   " if ok else "FAIL ") + json.dumps(result))
            print(
                f"-- schedule step {number} ({api}, groups {groups}): {time.monotonic() - t0:.1f} s"
            )
            del stores

        # Negative control: the previous trial's variables left in place (WORLD_SIZE=2 etc.)
        # while the trial asks for devices=4: Lightning must refuse, not train on a wrong group.
        # Under --env plain it does not check (world = devices x num_nodes): the rank waits in
        # init_process_group for peers that never come, so the wait is bounded at 20 s here
        # (Lightning's default is 30 minutes).
        stale = launcher_env(args.env, pinned, free_port(), "stale", 2, 1)
        order = {"kind": "trial", "trial": "stale-env", "api": "trainer", "env": stale}
        send(3, order | {"world": 4, "pinned": pinned, "timeout_s": 20})
        result = receive(3)
        verdict = "ok   " if "error" in result else "FAIL "
        print(f"{verdict}negative control (stale WORLD_SIZE=2, world 4): {json.dumps(result)}")
        failures += "error" not in result
        for i in range(4):
            send(i, {"kind": "quit"})
            workers[i].wait(timeout=60)
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for i, steps in history.items():
        print(f"warm process {i}: {', '.join(steps)}")
    print(f"verdict: {'every check passed' if failures == 0 else f'{failures} checks FAILED'}")


if __name__ == "__main__":
    main()
