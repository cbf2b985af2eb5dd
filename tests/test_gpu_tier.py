"""The GPU tier's plumbing, checked here without a GPU and without a launch: its modules
import and collect (tests that need more GPUs than the machine has are left out, named),
and ``make test-gpu`` on a machine without CUDA fails at once, saying why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
NO_GPU = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
"""Whatever this machine has: torch sees no CUDA device."""


def test_the_gpu_tests_import_and_collect_and_multi_gpu_ones_are_named_as_left_out() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests/gpu",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
        ],
        check=False,
        cwd=ROOT,
        env=NO_GPU,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "test_a_search_whose_trials_take_most_of_the_card_finishes_every_trial" in done.stdout
    assert "test_lightning_ddp_on_nccl_an_oom_trial_is_crashed_and_the_next_runs" in done.stdout
    assert (
        "left out tests/gpu/test_gpu.py::test_a_pool_of_two_gpus_with_two_rank_trials: needs 2"
        " GPUs, this machine has 0" in done.stdout
    ), done.stdout


def test_make_test_gpu_without_cuda_fails_at_once_saying_why() -> None:
    done = subprocess.run(
        ["make", "--no-print-directory", "test-gpu", f"GPU_PYTHON={sys.executable}"],
        check=False,
        cwd=ROOT,
        env=NO_GPU,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0, done.stdout + done.stderr
    output = done.stdout + done.stderr
    assert "make test-gpu needs a CUDA device; torch.cuda.is_available() is False here" in output
    assert "collected" not in output  # refused before any test was collected
