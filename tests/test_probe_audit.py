"""The probe's watch of the NePS root (tests/scripts/probe.py ``_watch``), on which
``assert_followers_never_touch_neps`` rests: every path call under the root is counted
(the audit hook, one test per kind of call), a C-level open too (the fd watch), and
nothing outside the root is.

Each case runs a small child process with the probe's watch installed on ``root``
(relative: resolved against the child's cwd, ``tmp_path``), does one kind of call and
prints what the probe counted. A case names the entries it expects in ``paths``
("<event> <path under the root>"), so removing its event from ``probe.PATH_ARGS`` (or
the fd watch) fails it; ``test_every_event_of_the_table_is_exercised`` keeps the table
and the cases in step.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from harness import SCRIPTS, assert_followers_never_touch_neps

_spec = importlib.util.spec_from_file_location("probe_under_test", SCRIPTS / "probe.py")
assert _spec is not None and _spec.loader is not None
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)  # not imported as "probe": no script folder on sys.path

PRELUDE = """
import ctypes, glob, json, os, pathlib, shutil, sqlite3, sys, tempfile, time
from contextlib import suppress
sys.path.insert(0, {scripts!r})
import probe
probe._watch(pathlib.Path({root!r}))
LIBC = ctypes.CDLL(None, use_errno=True)


def held_by_libc(path):
    '''Open ``path`` with libc's open() (no audit event), hold it until the fd watch has
    counted one more open file (bounded poll, 10 s), close it.'''
    before = probe.ROOT_ACCESS["fd_count"]
    fd = LIBC.open(os.fsencode(path), os.O_RDONLY)
    assert fd >= 0, ctypes.get_errno()
    deadline = time.monotonic() + 10
    while probe.ROOT_ACCESS["fd_count"] == before and time.monotonic() < deadline:
        time.sleep(0.01)
    LIBC.close(fd)
"""
EPILOGUE = """
print("ROOT_ACCESS=" + json.dumps(probe.ROOT_ACCESS))
"""


def make_tree(base: Path) -> None:
    """A file ``f``, a folder ``d`` holding ``g``, an archive ``a.tar`` of ``d``."""
    base.mkdir()
    (base / "f").write_text("f")
    (base / "d").mkdir()
    (base / "d" / "g").write_text("g")
    shutil.make_archive(str(base / "a"), "tar", root_dir=base, base_dir="d")


def watched(
    tmp_path: Path, action: str, *, root: str = "root", rank: str | None = None
) -> dict[str, Any]:
    """Run ``action`` in a child under the probe's watch of ``root``; what it counted.
    The child must exit 0 with nothing on stderr (the fd watch stops quietly)."""
    code = PRELUDE.format(scripts=str(SCRIPTS), root=root) + textwrap.dedent(action) + EPILOGUE
    env = {"PATH": "/usr/bin:/bin", "NB_RECORD_DIR": str(tmp_path / "rec")}
    if rank is not None:
        env["RANK"] = rank
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and not done.stderr, (done.returncode, done.stderr)
    line = next(x for x in done.stdout.splitlines() if x.startswith("ROOT_ACCESS="))
    access: dict[str, Any] = json.loads(line.removeprefix("ROOT_ACCESS="))
    return access


CASES: dict[str, tuple[str, list[str]]] = {
    # id: (what the child does, its cwd holding root/; entries expected in paths: exact,
    # or the entry's start where it ends with "...")
    "open": ("open('root/f').close()", ["open f"]),
    "os_open_write": ("os.close(os.open('root/n', os.O_WRONLY | os.O_CREAT))", ["open n"]),
    "pathlib_read": ("pathlib.Path('root/f').read_text()", ["open f"]),
    "bytes_path": ("open(b'root/f').close()", ["open f"]),
    "absolute_path": ("open(os.path.abspath('root/f')).close()", ["open f"]),
    "relative_to_a_moved_cwd": ("os.chdir('root/d'); open('g').close()", ["open d/g"]),
    "listdir": ("os.listdir('root')", ["os.listdir ."]),
    "scandir": ("list(os.scandir(pathlib.Path('root/d')))", ["os.scandir d"]),
    "mkdir": ("os.mkdir('root/new')", ["os.mkdir new"]),
    "makedirs": ("os.makedirs('root/x/y')", ["os.mkdir x", "os.mkdir x/y"]),
    "mkdir_dir_fd": (
        "os.mkdir('new', dir_fd=os.open('root/d', os.O_RDONLY))",
        ["os.mkdir d/new"],
    ),
    "rename": ("os.rename('root/f', 'root/f2')", ["os.rename f", "os.rename f2"]),
    "rename_into": (
        "open('outside', 'w').close(); os.replace('outside', 'root/in')",
        ["os.rename in"],
    ),
    "rename_out_of": ("os.rename('root/f', 'outside')", ["os.rename f"]),
    "link": ("os.link('root/f', 'root/l')", ["os.link f", "os.link l"]),
    "symlink": ("os.symlink('f', 'root/s')", ["os.symlink s"]),
    "remove": ("os.remove('root/f')", ["os.remove f"]),
    "unlink_dir_fd": ("os.unlink('g', dir_fd=os.open('root/d', os.O_RDONLY))", ["os.remove d/g"]),
    "rmdir": ("os.mkdir('root/e'); os.rmdir('root/e')", ["os.rmdir e"]),
    "truncate": ("os.truncate('root/f', 0)", ["os.truncate f"]),
    "utime": ("os.utime('root/f')", ["os.utime f"]),
    "touch": ("pathlib.Path('root/t').touch()", ["os.utime t"]),
    "chmod": ("os.chmod('root/f', 0o600)", ["os.chmod f"]),
    "chown": ("os.chown('root/f', os.getuid(), -1)", ["os.chown f"]),
    "chdir": ("os.chdir('root/d')", ["os.chdir d"]),
    "xattr": (
        """
        for call in (
            lambda: os.listxattr('root/f'),
            lambda: os.getxattr('root/f', 'user.nb'),
            lambda: os.setxattr('root/f', 'user.nb', b'1'),
            lambda: os.removexattr('root/f', 'user.nb'),
        ):
            with suppress(OSError):  # the event comes before the call (tmpfs: no user.*)
                call()
        """,
        ["os.listxattr f", "os.getxattr f", "os.setxattr f", "os.removexattr f"],
    ),
    "walk": ("list(os.walk('root'))", ["os.walk ."]),
    "fwalk": ("list(os.fwalk('root'))", ["os.fwalk ."]),
    "glob": ("glob.glob('root/*')", ["glob.glob *"]),
    "glob_root_dir": ("glob.glob('*', root_dir='root/d')", ["glob.glob/2 d/*"]),
    "pathlib_glob": (
        "list(pathlib.Path('root').glob('*')); list(pathlib.Path('root').rglob('g'))",
        ["pathlib.Path.glob .", "pathlib.Path.rglob ."],
    ),
    "copyfile": ("shutil.copyfile('root/f', 'root/c')", ["shutil.copyfile f", "shutil.copyfile c"]),
    "copy_out_of": (
        "shutil.copy2('root/f', 'outside')",
        ["shutil.copyfile f", "shutil.copystat f"],
    ),
    "copymode": (
        "shutil.copymode('root/f', 'root/d/g')",
        ["shutil.copymode f", "shutil.copymode d/g"],
    ),
    "copytree": (
        "shutil.copytree('root/d', 'root/d2')",
        ["shutil.copytree d", "shutil.copytree d2"],
    ),
    "move": ("shutil.move('root/f', 'root/d')", ["shutil.move f", "shutil.move d"]),
    "rmtree": ("shutil.rmtree('root/d')", ["shutil.rmtree d", "os.rmdir d"]),
    "shutil_chown": ("shutil.chown('root/f', user=os.getuid())", ["shutil.chown f"]),
    "make_archive": (
        "shutil.make_archive('root/b', 'tar', root_dir='root/d')",
        ["shutil.make_archive b", "shutil.make_archive d"],
    ),
    "unpack_archive": (
        "shutil.unpack_archive('root/a.tar', 'root/u')",
        ["shutil.unpack_archive a.tar", "shutil.unpack_archive u"],
    ),
    "mkstemp": ("tempfile.mkstemp(dir='root')", ["tempfile.mkstemp tmp..."]),
    "mkdtemp": ("tempfile.mkdtemp(dir='root')", ["tempfile.mkdtemp tmp..."]),
    "sqlite": ("sqlite3.connect('root/db').close()", ["sqlite3.connect db"]),
}


@pytest.mark.parametrize(("action", "expected"), list(CASES.values()), ids=list(CASES))
def test_a_path_call_under_the_root_is_counted(
    tmp_path: Path, action: str, expected: list[str]
) -> None:
    make_tree(tmp_path / "root")
    access = watched(tmp_path, action)
    for entry in expected:
        if entry.endswith("..."):
            assert any(p.startswith(entry[:-3]) for p in access["paths"]), (entry, access)
        else:
            assert entry in access["paths"], (entry, access)
    assert access["count"] >= len(expected), access


def test_every_event_of_the_table_is_exercised() -> None:
    """Each event ``probe.PATH_ARGS`` names (and ``glob.glob/2``) is one a case above
    expects, so each entry of the table was seen raised by this interpreter, with the
    path where the table says."""
    expected = {entry.split(" ")[0] for _, entries in CASES.values() for entry in entries}
    assert set(probe.PATH_ARGS) | {"glob.glob/2"} <= expected


def test_a_c_level_open_is_seen_by_the_fd_watch_on_every_rank(tmp_path: Path) -> None:
    """libc's open() raises no audit event: only the fd watch sees it. The leader counts
    it in ``fd_count`` only (its positive control), a follower in ``count`` too."""
    make_tree(tmp_path / "root")
    leader = watched(tmp_path, "held_by_libc('root/f')")
    assert leader["fd_count"] == 1 and leader["fd_paths"] == ["fd f"], leader
    assert leader["count"] == 0 and leader["paths"] == [], leader
    follower = watched(tmp_path, "held_by_libc('root/d/g')", rank="1")
    assert follower["fd_count"] == 1 and follower["fd_paths"] == ["fd d/g"], follower
    assert follower["count"] == 1 and follower["paths"] == ["fd d/g"], follower


def test_a_file_python_holds_open_is_seen_by_the_fd_watch_too(tmp_path: Path) -> None:
    make_tree(tmp_path / "root")
    action = """
    f = open('root/f')
    deadline = time.monotonic() + 10
    while probe.ROOT_ACCESS["fd_count"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    f.close()
    """
    access = watched(tmp_path, action, rank="2")
    assert access["fd_paths"] == ["fd f"], access
    assert access["paths"] == ["open f", "fd f"], access


def test_nothing_outside_the_root_is_counted(tmp_path: Path) -> None:
    """Every case above, each on a fresh tree of its own outside the root: ``root<n>``
    (the root's name as a prefix of theirs) and ``elsewhere/<n>``; every call succeeds.
    Then files held open there (by Python and by libc) while one under the root is held
    by libc until the fd watch counts it: that one is the only entry, in both counters
    (so the fd watch looked while the outside ones were held)."""
    make_tree(tmp_path / "root")
    (tmp_path / "elsewhere").mkdir()
    outside = []
    for n, (action, _) in enumerate([*CASES.values(), *CASES.values()]):
        base = f"root{n}" if n < len(CASES) else f"elsewhere/{n}"
        make_tree(tmp_path / base)
        moved = action.replace("'root/", f"'{base}/").replace("'root'", f"'{base}'")
        assert not re.search(r"""['"]root['"/]""", moved), moved
        outside += [textwrap.dedent(moved).strip(), f"os.chdir({str(tmp_path)!r})"]
    held = """
    held = open('elsewhere/0/f')
    fd = LIBC.open(b'root0/f', os.O_RDONLY)
    held_by_libc('root/f')
    held.close()
    LIBC.close(fd)
    """
    (tmp_path / "root0" / "f").write_text("f")  # its own case may have moved it
    make_tree(tmp_path / "elsewhere" / "0")
    action = "\n".join([*outside, textwrap.dedent(held)])
    access = watched(tmp_path, action, rank="1")
    assert access["paths"] == ["fd f"] and access["count"] == 1, access
    assert access["fd_paths"] == ["fd f"] and access["fd_count"] == 1, access


def test_an_fd_given_as_a_path_and_a_bad_argument_are_ignored_quietly(tmp_path: Path) -> None:
    make_tree(tmp_path / "root")
    action = """
    fd = os.open('root/d', os.O_RDONLY)
    os.listdir(fd)
    os.chdir(fd)
    os.mkdir('x', dir_fd=fd)
    os.close(fd)
    with suppress(OSError):
        os.mkdir('y', dir_fd=fd)  # a closed dir_fd: its folder cannot be read
    sys.audit("os.rename", None, object(), "a", -1)
    sys.audit("os.mkdir")
    """
    access = watched(tmp_path, action)
    assert access["paths"] == ["open d", "os.mkdir d/x"], access


def test_a_symlinked_spelling_of_the_root_is_counted(tmp_path: Path) -> None:
    """The root given through a symlink: an access through the real folder counts."""
    make_tree(tmp_path / "real")
    (tmp_path / "root").symlink_to(tmp_path / "real")
    access = watched(tmp_path, "open('real/f').close(); os.listdir('root')")
    assert access["paths"] == ["open f", "os.listdir ."], access


def exit_record(rank: int, **access: Any) -> dict[str, Any]:
    calls = {"neps.run": int(rank == 0), "NePSState.create_or_load": int(rank == 0)}
    root_access = {"count": 0, "paths": [], "fd_count": 0, "fd_paths": []}
    if rank == 0:
        root_access.update(count=3, paths=["open a"], fd_count=1, fd_paths=["fd a"])
    root_access.update(access)
    return {"calls": calls, "root_access": root_access}


def test_the_harness_passes_a_clean_group() -> None:
    assert_followers_never_touch_neps({0: exit_record(0), 1: exit_record(1)})


@pytest.mark.parametrize(
    "exits",
    [
        {0: exit_record(0), 1: exit_record(1, count=1, paths=["os.mkdir x"])},
        {0: exit_record(0), 1: exit_record(1, fd_count=1, fd_paths=["fd x"])},
        {0: exit_record(0), 1: {**exit_record(1), "root_access": {"count": 0, "paths": []}}},
        {0: exit_record(0, fd_count=0, fd_paths=[]), 1: exit_record(1)},
        {0: exit_record(0, count=0, paths=[]), 1: exit_record(1)},
        {0: exit_record(0)},
    ],
    ids=[
        "follower_path_call",
        "follower_open_file",
        "follower_without_the_fd_watch",
        "leader_fd_watch_saw_nothing",
        "leader_hook_saw_nothing",
        "no_follower",
    ],
)
def test_the_harness_fails_a_group_whose_follower_touched_the_root_or_whose_leader_did_not(
    exits: dict[int, dict[str, Any]],
) -> None:
    with pytest.raises(AssertionError):
        assert_followers_never_touch_neps(exits)
