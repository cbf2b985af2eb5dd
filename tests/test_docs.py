"""README.md and docs/ stay true: short README, links that resolve, commands that work.

- README.md stays a landing page (at most ``MAX_README_LINES`` lines).
- Every relative link in README.md and docs/*.md names a file that exists, and every
  ``#anchor`` a heading of that file (GitHub's slugs).
- docs/configuration.md is exactly what docs/generate_configuration.py prints.
- Every command shown in a ```bash / ```sh / ```console block works as written, as far
  as can be checked without starting a search: its program is one this test knows, and
  that program's ``--help`` runs with exit status 0 and lists every option the command
  uses. A command whose program this test does not know fails (it is never skipped):
  add a check for it to ``KNOWN``. ``sbatch`` is not run: the script it names must exist.
  ``srun``'s inner command is checked like any other.

Collecting commands: in a block with ``$ `` prompts only the prompted lines are commands
(the rest is output); otherwise every line that is not blank or a comment. A line ending
in ``\\`` continues on the next. Leading ``NAME=value`` assignments, ``# comments``,
redirections and ``$(...)`` (checked as a command of its own) are taken off; ``&&``,
``||``, ``;`` and ``|`` separate commands.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = (README, *sorted(DOCS.glob("*.md")))
GENERATOR = DOCS / "generate_configuration.py"
PACKAGE = ROOT / "src" / "neps_bcast"
MAX_README_LINES = 170
COMMAND_LANGUAGES = {"bash", "sh", "shell", "console"}
BIN = Path(sys.executable).parent
HELP_TIMEOUT_S = 180


class DocCommandError(AssertionError):
    """A command shown in the docs that does not work as written."""


# ---------------------------------------------------------------- reading the pages


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    lines: tuple[str, ...]


@dataclass(frozen=True)
class Command:
    page: Path
    line: int
    text: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}: {self.text}"


def code_blocks(page: Path) -> list[Block]:
    blocks: list[Block] = []
    fence: tuple[int, str, str] | None = None  # (line, marker, language)
    body: list[str] = []
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        stripped = line.strip()
        if fence is None:
            match = re.match(r"(`{3,}|~{3,})\s*([\w+-]*)", stripped)
            if match:
                fence, body = (number, match.group(1), match.group(2).lower()), []
        elif stripped.startswith(fence[1]) and not stripped.strip(fence[1][0]):
            blocks.append(Block(page, fence[0], fence[2], tuple(body)))
            fence = None
        else:
            body.append(line)
    if fence is not None:
        raise AssertionError(f"{page.relative_to(ROOT)}:{fence[0]}: a code block is never closed")
    return blocks


def prose(page: Path) -> list[tuple[int, str]]:
    """The page's lines outside code blocks (fenced blocks blanked), numbered from 1."""
    lines = page.read_text().splitlines()
    inside: set[int] = set()
    for block in code_blocks(page):
        inside.update(range(block.line, block.line + len(block.lines) + 2))
    return [(n, "" if n in inside else text) for n, text in enumerate(lines, start=1)]


def commands_of(block: Block) -> list[Command]:
    lines = [line.rstrip() for line in block.lines]
    prompted = any(line.lstrip().startswith("$ ") for line in lines)
    found: list[Command] = []
    i = 0
    while i < len(lines):
        start, line = i, lines[i].strip()
        i += 1
        if prompted:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        if not line or line.startswith("#"):
            continue
        while line.endswith("\\") and i < len(lines):
            line = line[:-1].rstrip() + " " + lines[i].strip()
            i += 1
        found.append(Command(block.page, block.line + 1 + start, line))
    return found


def all_commands() -> list[Command]:
    return [
        command
        for page in PAGES
        for block in code_blocks(page)
        if block.language in COMMAND_LANGUAGES
        for command in commands_of(block)
    ]


# ---------------------------------------------------------------- shell words


def strip_shell(text: str) -> tuple[str, list[str]]:
    """``text`` without its comment, with each ``$(...)`` replaced by a word; the inner
    commands of those substitutions."""
    out: list[str] = []
    inner: list[str] = []
    quote = ""
    i = 0
    while i < len(text):
        char = text[i]
        if quote:
            out.append(char)
            if char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
            out.append(char)
        elif char == "#" and (i == 0 or text[i - 1].isspace()):
            break
        elif text.startswith("$(", i):
            depth, j, inner_quote = 1, i + 2, ""
            while j < len(text) and depth:
                c = text[j]
                if inner_quote:
                    inner_quote = "" if c == inner_quote else inner_quote
                elif c in "'\"":
                    inner_quote = c
                elif c == "(":
                    depth += 1
                elif c == ")":
                    depth -= 1
                j += 1
            if depth:
                raise DocCommandError(f"unbalanced $( in {text!r}")
            inner.append(text[i + 2 : j - 1])
            out.append("SUBSTITUTED")
            i = j
            continue
        else:
            out.append(char)
        i += 1
    return "".join(out), inner


ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
SEPARATORS = {"&&", "||", ";", "|", "&"}
REDIRECTIONS = {">", ">>", "<", ">&", "<&"}


def simple_commands(text: str) -> Iterator[list[str]]:
    """Each simple command of ``text`` as words, environment assignments taken off."""
    stripped, substitutions = strip_shell(text)
    for inner in substitutions:
        yield from simple_commands(inner)
    lexer = shlex.shlex(stripped, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    words: list[str] = []
    try:
        tokens = list(lexer)
    except ValueError as error:
        raise DocCommandError(f"not valid shell: {text!r} ({error})") from None
    tokens.append(";")
    skip_next = False
    for token in tokens:
        if skip_next:
            skip_next = False
        elif token in SEPARATORS:
            while words and ASSIGNMENT.match(words[0]):
                words.pop(0)
            if words:
                yield words
            words = []
        elif token in REDIRECTIONS:
            if words and words[-1].isdigit():
                words.pop()  # 2>/dev/null: the descriptor
            skip_next = True
        else:
            words.append(token)


# ---------------------------------------------------------------- running --help


@functools.cache
def run_help(argv: tuple[str, ...]) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HELP_TIMEOUT_S, check=False
    )
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise DocCommandError(
            f"`{shlex.join(argv)}` exited with {proc.returncode}; expected 0. Output:\n{output[-3000:]}"
        )
    return output


def check_options(words: list[str], help_argv: tuple[str, ...], what: str) -> None:
    """Every option in ``words`` is one that ``help_argv``'s output lists."""
    text = run_help(help_argv)
    for word in words:
        if not word.startswith("-") or word in {"-", "--"}:
            continue
        option = word.split("=", 1)[0]
        if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text):
            raise DocCommandError(
                f"{what} has no option {option!r} (not in `{shlex.join(help_argv)}`)"
            )


def program(name: str, module: str) -> tuple[str, ...]:
    """A console script of this environment, or the module that provides it."""
    script = BIN / name
    return (str(script),) if script.exists() else (sys.executable, "-m", module)


def script_index(words: list[str]) -> int:
    for i, word in enumerate(words):
        if word.endswith(".py"):
            return i
    raise DocCommandError(f"no .py script in {shlex.join(words)!r}")


def check_script(words: list[str]) -> None:
    """``X.py args``: the file exists, its ``--help`` runs and lists every option used."""
    path = ROOT / words[0]
    if not path.is_file():
        raise DocCommandError(f"the script {words[0]} does not exist")
    check_options(words[1:], (sys.executable, words[0], "--help"), words[0])


def check_neps_bcast(args: list[str]) -> None:
    if not args:
        raise DocCommandError("`neps-bcast` without a command")
    base = program("neps-bcast", "neps_bcast")
    command, rest = args[0], args[1:]
    run_help((*base, "--help"))
    if command.startswith("-"):
        check_options(args, (*base, "--help"), "neps-bcast")
        return
    if not any(word.endswith(".py") for word in rest):
        check_options(rest, (*base, command, "--help"), f"neps-bcast {command}")
        return
    at = script_index(rest)
    check_options(rest[:at], (*base, command, "--help"), f"neps-bcast {command}")
    check_script(rest[at:])


def check_torchrun(args: list[str]) -> None:
    base = program("torchrun", "torch.distributed.run")
    at = script_index(args)
    check_options(args[:at], (*base, "--help"), "torchrun")
    check_script(args[at:])


def check_python(args: list[str]) -> None:
    if args[:2] == ["-m", "neps_bcast"]:
        check_neps_bcast(args[2:])
    elif args[:2] == ["-m", "torch.distributed.run"]:
        check_torchrun(args[2:])
    elif args[:1] == ["-c"] and len(args) >= 2:
        compile(args[1], "<python -c in the docs>", "exec")  # syntax only; nothing runs
    elif args and args[0].endswith(".py"):
        check_script(args)
    else:
        raise DocCommandError(
            f"python {shlex.join(args)}: only `python X.py`, `python -c CODE`, `python -m"
            " neps_bcast` and `python -m torch.distributed.run` are known; add it to the"
            " known programs"
        )


def makefile_targets() -> set[str]:
    targets: set[str] = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        match = re.match(r"([A-Za-z0-9_.%-][A-Za-z0-9_. %-]*):(?!=)", line)
        if match:
            targets.update(match.group(1).split())
    return targets


def check_make(args: list[str]) -> None:
    targets = [a for a in args if not a.startswith("-") and not ASSIGNMENT.match(a)]
    known = makefile_targets()
    for target in targets:
        if target not in known:
            raise DocCommandError(f"the Makefile has no target {target!r} (has: {sorted(known)})")


def check_pip(args: list[str]) -> None:
    if not args or args[0].startswith("-"):
        raise DocCommandError(f"pip {shlex.join(args)}: expected a pip command")
    check_options(args[1:], (sys.executable, "-m", "pip", args[0], "--help"), f"pip {args[0]}")


def check_sbatch(args: list[str]) -> None:
    """Not run (SLURM exists here only under make test-slurm): the script must exist."""
    scripts = [a for a in args if not a.startswith("-")]
    if not scripts:
        raise DocCommandError("sbatch without a script")
    if not (ROOT / scripts[0]).is_file():
        raise DocCommandError(f"the sbatch script {scripts[0]} does not exist")


def check_srun(args: list[str]) -> None:
    """Not run: the command srun starts is checked like any other (options as --opt=value)."""
    inner = [a for a in args if not a.startswith("-")]
    if not inner:
        raise DocCommandError("srun without a command")
    check_words(args[args.index(inner[0]) :])


def check_export(args: list[str]) -> None:
    for arg in args:
        if not ASSIGNMENT.match(arg):
            raise DocCommandError(f"export {arg!r}: expected NAME=value")


KNOWN: dict[str, Callable[[list[str]], None]] = {
    "neps-bcast": check_neps_bcast,
    "torchrun": check_torchrun,
    "python": check_python,
    "python3": check_python,
    "make": check_make,
    "pip": check_pip,
    "sbatch": check_sbatch,
    "srun": check_srun,
    "export": check_export,
}


def check_words(words: list[str]) -> None:
    name, args = words[0], words[1:]
    check = KNOWN.get(name)
    if check is None:
        raise DocCommandError(
            f"{name!r} is not a program tests/test_docs.py knows how to check: add it to the"
            f" known programs (KNOWN), with a check that it works as written"
        )
    check(args)


def check_command(text: str) -> None:
    commands = list(simple_commands(text))
    if not commands:
        raise DocCommandError(f"no command in {text!r}")
    for words in commands:
        check_words(words)


# ---------------------------------------------------------------- links and anchors


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # links: their text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    counts: dict[str, int] = {}
    found: set[str] = set()
    for _, line in prose(page):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = counts.get(base, 0)
        counts[base] = count + 1
        found.add(f"{base}-{count}" if count else base)  # GitHub numbers repeated headings
    return found


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)")


@dataclass(frozen=True)
class Link:
    page: Path
    line: int
    target: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}: {self.target}"


def links_of(page: Path) -> list[Link]:
    found: list[Link] = []
    for number, line in prose(page):
        text = re.sub(r"`[^`]*`", "code", line)
        targets = [m.group(1) for m in LINK.finditer(text)]
        targets += [m.group(1) for m in REFERENCE.finditer(text)]
        found += [Link(page, number, target) for target in targets]
    return found


def is_relative(target: str) -> bool:
    return not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) and not target.startswith("//")


def all_links() -> list[Link]:
    return [link for page in PAGES for link in links_of(page) if is_relative(link.target)]


COMMANDS = all_commands()
LINKS = all_links()


# ---------------------------------------------------------------- the tests


def test_readme_is_a_landing_page() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines; expected at most {MAX_README_LINES}: move the detail"
        " to a page in docs/ and link it"
    )


def test_the_pages_show_commands_and_links() -> None:
    """A collection that finds nothing would pass every parametrized test vacuously."""
    readme_commands = [c for c in COMMANDS if c.page == README]
    assert len(readme_commands) >= 5, [c.id for c in COMMANDS]
    assert any(link.page == README for link in LINKS)
    assert len(PAGES) >= 7, [p.name for p in PAGES]


@pytest.mark.parametrize("link", LINKS, ids=[link.id for link in LINKS])
def test_relative_link_resolves(link: Link) -> None:
    path, _, anchor = link.target.partition("#")
    target = (link.page.parent / path).resolve() if path else link.page
    assert target.exists(), f"{link.id}: {target.relative_to(ROOT)} does not exist"
    if anchor:
        assert target.suffix == ".md", f"{link.id}: an anchor into a file that is not markdown"
        assert anchor in anchors(target), (
            f"{link.id}: no heading of {target.relative_to(ROOT)} has the anchor #{anchor};"
            f" its anchors: {sorted(anchors(target))}"
        )


@pytest.mark.parametrize("command", COMMANDS, ids=[command.id for command in COMMANDS])
def test_command_works_as_written(command: Command) -> None:
    try:
        check_command(command.text)
    except DocCommandError as error:
        pytest.fail(f"{command.id}\n{error}", pytrace=False)


def _script(path: Path) -> ModuleType:
    """A generator script under docs/, loaded as a module."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generator() -> ModuleType:
    return _script(GENERATOR)


def test_configuration_page_is_generated() -> None:
    page = DOCS / "configuration.md"
    expected = _generator().render()
    assert page.exists() and page.read_text() == expected, (
        "docs/configuration.md differs from what docs/generate_configuration.py renders from"
        " neps_bcast.config: run `make docs` and commit the result"
    )


def test_configuration_page_lists_every_variable() -> None:
    import neps_bcast.config as config

    text = (DOCS / "configuration.md").read_text()
    names = [var.name for var in config.VARIABLES] + list(config.INTERNAL)
    names.append(_generator().secret_variable())
    missing = [name for name in names if f"`{name}`" not in text]
    assert not missing, f"docs/configuration.md does not list {missing}"


FILE_SPAN = re.compile(r"`([\w.-]+(?:/[\w.-]+)+\.(?:py|sh|sbatch|md|lock|toml|json|png))`")


def test_files_named_in_the_text_exist() -> None:
    """A path in backticks names a file of the repository, of src/ or of the package
    (``neps_bcast/transport/watchdog.py``, ``transport/watchdog.py``): a module that moves
    takes its docs along."""
    missing = [
        f"{page.relative_to(ROOT)}:{n}: {name}"
        for page in PAGES
        for n, line in prose(page)
        for name in FILE_SPAN.findall(line)
        if not any((base / name).exists() for base in (ROOT, ROOT / "src", PACKAGE))
    ]
    assert not missing, "files named in the docs that do not exist:\n" + "\n".join(missing)


def test_no_tracker_issue_numbers() -> None:
    pattern = re.compile(r"\bissues?\s+#?\d+|(?<![\w/#&])#\d+\b", re.IGNORECASE)
    found = [
        f"{page.relative_to(ROOT)}:{n}: {line.strip()}"
        for page in PAGES
        for n, line in enumerate(page.read_text().splitlines(), start=1)
        if pattern.search(line)
    ]
    assert not found, (
        "issue numbers in the docs (say what the behaviour is instead):\n" + "\n".join(found)
    )


# Positive controls: the checks above can fail.


def test_an_unknown_program_fails_and_says_how_to_fix_it() -> None:
    with pytest.raises(DocCommandError, match="add it to the known programs"):
        check_command("frobnicate --fast")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("torchrun --no-such-option 2 examples/torchrun_ddp.py", "no option '--no-such-option'"),
        ("python examples/torchrun_ddp.py --no-such-flag", "no option '--no-such-flag'"),
        ("python examples/no_such_example.py --trials 2", "does not exist"),
        ("make no-such-target", "no target 'no-such-target'"),
        ("sbatch examples/no_such.sbatch", "does not exist"),
        ("OMP_NUM_THREADS=1 srun --ntasks=2 neps-bcast no-such-command", "exited with"),
    ],
)
def test_a_broken_command_fails(text: str, message: str) -> None:
    with pytest.raises(DocCommandError, match=re.escape(message)):
        check_command(text)


def test_commands_are_split_as_the_shell_would() -> None:
    text = "OMP_NUM_THREADS=1 make demo && export A=$(python -c 'print(1)') # a comment"
    assert list(simple_commands(text)) == [
        ["python", "-c", "print(1)"],
        ["make", "demo"],
        ["export", "A=SUBSTITUTED"],
    ]


def test_anchors_are_githubs_slugs() -> None:
    assert slug("Several DDP groups per node: `neps-bcast launch`") == (
        "several-ddp-groups-per-node-neps-bcast-launch"
    )
    assert slug('Lightning `strategy="ddp"` (Lightning starts the ranks)') == (
        "lightning-strategyddp-lightning-starts-the-ranks"
    )


def _fault_tables() -> ModuleType:
    return _script(DOCS / "generate_fault_table.py")


def test_fault_sweep_page_is_generated_from_the_sweeps_table() -> None:
    generator = _fault_tables()
    page = DOCS / "fault-sweep.md"
    assert page.exists() and page.read_text() == generator.render_page(generator.table()), (
        "docs/fault-sweep.md differs from what docs/generate_fault_table.py renders from"
        " tests/sweep/table.py: run `make docs` and commit the result"
    )


def test_how_a_trial_ends_is_generated_from_the_sweeps_table() -> None:
    generator = _fault_tables()
    text = (DOCS / "failures.md").read_text()
    assert generator.render_failures(generator.table(), text) == text, (
        "docs/failures.md's 'How a trial ends' differs from tests/sweep/table.py's ROWS:"
        " run `make docs` and commit the result"
    )


# -- the README's quickstart runs as written -----------------------------------------------
QUICKSTART = ROOT / "examples" / "quickstart.py"
QUICKSTART_ROOT = "results/quickstart"
"""The ``root_directory`` the quickstart passes, relative to where it runs."""


def readme_python_blocks() -> list[Block]:
    return [b for b in code_blocks(README) if b.language == "python"]


def test_the_readme_quickstart_is_taken_verbatim_from_its_file() -> None:
    """The README shows a part of examples/quickstart.py, which it links: every line of
    the block, in order and contiguous, is in the file (so the names it uses, ``Model``,
    ``data``, ``Space``, are the file's, defined there)."""
    assert f"]({QUICKSTART.relative_to(ROOT)})" in README.read_text()
    blocks = readme_python_blocks()
    assert len(blocks) == 1, "README.md has one python block: the quickstart"
    shown = "\n".join(blocks[0].lines)
    assert shown in QUICKSTART.read_text(), (
        "README.md's quickstart differs from examples/quickstart.py: copy the file's part"
        " into the README (or change both)"
    )


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """``python examples/quickstart.py`` as the README says, in a fresh folder: one
    Lightning ddp launch of 2 CPU ranks, 4 trials (harness.run: every process of it is
    found by its marker)."""
    from harness import python, run

    tmp = tmp_path_factory.mktemp("quickstart")
    return tmp, run(python(QUICKSTART), tmp, name="quickstart", timeout=300.0)


def test_the_quickstart_runs_as_written_and_leaves_nothing(quickstart: tuple[Path, Any]) -> None:
    _, result = quickstart
    assert (result.returncode, result.left_alive) == (0, []), result.tail()


def test_the_quickstart_search_is_complete_in_neps_and_in_the_status(
    quickstart: tuple[Path, Any],
) -> None:
    from harness import states

    tmp, _ = quickstart
    root = tmp / QUICKSTART_ROOT
    recorded = states(root)
    assert len(recorded) == 4 and set(recorded.values()) == {"success"}, recorded
    shown = subprocess.run(
        [*program("neps-bcast", "neps_bcast"), "status", str(root), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    status = json.loads(shown.stdout)
    assert {t["trial_id"]: t["state"] for t in status["trials"]} == recorded
    assert status["best"]["state"] == "success"
    assert (root / "summary" / "full.csv").is_file()  # where the README says results are


# -- every guarantee of the README names the tests that prove it ----------------------------
GUARANTEES: dict[str, tuple[str, ...]] = {
    "All ranks evaluate the same trial with the same arguments, in the leader's order.": (
        "tests/test_e2e_guarantees.py::TestEveryRankEvaluatesTheLeadersTrials::test_every_rank_evaluated_the_leaders_trials_with_the_same_arguments[2_ranks]",
        "tests/e2e/test_e2e_external.py::TestTorchrunLightningReusesTheGroup::test_every_rank_evaluated_the_leaders_trials_with_the_same_arguments",
    ),
    "On a follower, neps_bcast never calls `neps.run` and never reads or creates anything under the NePS root; only your own code may (a checkpoint in `pipeline_directory` to resume from, which then needs a filesystem every rank sees).": (
        "tests/test_e2e_guarantees.py::TestEveryRankEvaluatesTheLeadersTrials::test_followers_never_touched_neps_or_its_root[2_ranks]",
        "tests/test_e2e_guarantees.py::TestEveryRankEvaluatesTheLeadersTrials::test_the_leader_touched_neps_and_its_root[2_ranks]",
        "tests/e2e/test_e2e_external.py::TestTwoNodesFollowersNeedNoNepsRoot::test_followers_never_touched_neps_or_its_root",
        "tests/e2e/test_e2e_requeue.py::test_a_stopped_trial_goes_back_to_pending_and_resumes_from_its_checkpoint[sigterm_handler_installed_before_run]",
    ),
    "An exception on any rank inside `session()` raises `TrialFailedError` on every rank within about a second, and NePS records the trial as crashed with every failing rank's traceback.": (
        "tests/test_e2e_guarantees.py::TestErrorsFailTheTrialOnEveryRankAndTheSearchGoesOn::test_every_ranks_session_raised_naming_the_failing_rank[follower_in_fit]",
        "tests/test_e2e_guarantees.py::TestErrorsFailTheTrialOnEveryRankAndTheSearchGoesOn::test_every_ranks_session_raised_because_of_its_fault_not_a_timeout",
        "tests/test_e2e_guarantees.py::TestErrorsFailTheTrialOnEveryRankAndTheSearchGoesOn::test_a_followers_error_is_recorded_with_its_traceback",
        "tests/test_e2e_guarantees.py::TestErrorsFailTheTrialOnEveryRankAndTheSearchGoesOn::test_the_same_error_on_every_rank_is_recorded_once_listing_the_ranks",
    ),
    "With NePS's default `ignore_errors=False`, the leader's `neps.run` then raises (`WorkerRaiseError`, exit code 1) after the trial is recorded, and its followers exit 0; with `ignore_errors=True` the search goes on.": (
        "tests/e2e/test_e2e_failures.py::TestNepsDefaultStopsTheSearchAfterRecordingTheTrial::test_neps_recorded_trial_1_a_success_and_trial_2_crashed",
        "tests/e2e/test_e2e_failures.py::TestNepsDefaultStopsTheSearchAfterRecordingTheTrial::test_the_leader_exited_with_1_raising_neps_error",
        "tests/e2e/test_e2e_failures.py::TestNepsDefaultStopsTheSearchAfterRecordingTheTrial::test_the_follower_exited_with_0_because_its_leader_said_so",
        "tests/test_e2e_guarantees.py::TestErrorsFailTheTrialOnEveryRankAndTheSearchGoesOn::test_a_trial_without_a_fault_is_a_success[8]",
    ),
    "A lost rank, SIGTERM (preemption, exit 143), a requeue-and-exit handler or a killed leader does not lose the trial: it goes back to `pending` (up to `NEPS_BCAST_MAX_RETRIES` times) and the next run or requeued job evaluates it.": (
        "tests/e2e/test_e2e_recovery.py::TestAKilledFollowerIsRetriedUpToTheLimitThenCrashed::test_after_the_first_kill_the_trial_is_pending",
        "tests/test_e2e_guarantees.py::TestSigtermToTheWholeLaunchPutsTheTrialBack::test_the_interrupted_trial_is_pending",
        "tests/e2e/test_e2e_requeue.py::test_a_stopped_trial_goes_back_to_pending_and_resumes_from_its_checkpoint[usr1_handler_that_exits]",
        "tests/test_e2e_guarantees.py::TestTheLeaderKilledTheOrphanIsEvaluatedByTheRerun::test_the_rerun_ends_with_four_successes",
    ),
    "When the leader's `neps.run` returns, every process of the launch exits 0 and none is left running.": (
        "tests/test_e2e_guarantees.py::TestEveryRankEvaluatesTheLeadersTrials::test_every_process_that_started_exited_with_0[2_ranks]",
        "tests/test_e2e_guarantees.py::TestEveryRankEvaluatesTheLeadersTrials::test_no_process_of_the_launch_is_left[2_ranks]",
        "tests/e2e/test_e2e_external.py::TestTorchrunLightningReusesTheGroup::test_every_process_that_started_exited_with_0",
        "tests/e2e/test_e2e_external.py::TestTorchrunLightningReusesTheGroup::test_no_process_of_the_launch_is_left",
    ),
    "In a pool, a lost process costs only its own trial: it goes back to `pending` and runs again on fresh ranks while the other trials go on. A frozen agent or rank is SIGKILLed by the launcher within `NEPS_BCAST_PEER_TIMEOUT_S`, and a frozen launcher by its agents and ranks, each then ending as a killed one does.": (
        "tests/e2e/test_e2e_pool.py::TestARankKilledInATrialPutsOnlyThatTrialBack::test_the_killed_trial_went_back_to_pending_and_ran_again",
        "tests/e2e/test_e2e_pool.py::TestARankKilledInATrialPutsOnlyThatTrialBack::test_no_other_trial_was_affected",
        "tests/test_pool_beats.py::test_a_frozen_member_is_found_silent_after_the_bound_and_a_live_one_never",
        "tests/test_pool_beats.py::test_a_member_sigkills_its_own_silent_launcher_and_no_other_process",
        "tests/sweep/test_pool_sweep.py::test_every_fault_on_the_pool[pool-ranks]",
        "tests/sweep/test_pool_sweep.py::test_every_fault_on_the_pool[pool-launcher]",
    ),
    "A silent rank (frozen, its node lost or cut off: nothing closes) is treated as lost within `NEPS_BCAST_PEER_TIMEOUT_S` (30 s) and a few seconds: every surviving rank ends, naming it, its host, its step and how long it was silent, and the trial goes back to `pending`; a busy rank is never taken for silent.": (
        "tests/test_liveness.py::test_a_follower_finds_its_frozen_leader_silent_within_the_bound",
        "tests/test_liveness.py::test_the_leader_finds_a_follower_whose_beats_stopped_silent_and_names_its_step",
        "tests/test_liveness.py::test_a_main_thread_that_holds_the_gil_for_half_the_bound_is_never_silent",
        "tests/e2e/test_e2e_silent.py::TestTorchrunAFrozenFollowerIsKilledAndItsTrialPutBack::test_the_leader_exited_1_with_follower_lost_naming_the_silence",
        "tests/e2e/test_e2e_silent.py::TestTorchrunAFrozenLeaderIsKilledByItsFollower::test_the_survivor_names_the_silent_rank_its_pid_host_and_step",
        "tests/e2e/test_e2e_silent.py::TestLightningAFrozenFollowerIsKilledAndItsTrialPutBack::test_trial_1_is_a_success_and_trial_2_left_as_expected",
        "tests/e2e/test_e2e_silent.py::TestBusyRanksAreNeverTakenForSilent::test_no_log_says_a_rank_was_silent",
        "tests/e2e/test_e2e_silent.py::TestASearchUnderLoadIsNeverTakenForSilent::test_no_log_says_a_rank_was_silent",
        "tests/hosts/test_hosts.py::TestTheFollowersHostCutOffMidTraining::test_every_rank_on_a_reachable_host_logs_an_error_naming_the_silent_rank",
        "tests/hosts/test_hosts.py::TestTheLeadersHostCutOffMidTraining::test_the_interrupted_trial_went_back_to_pending",
    ),
    "A rank that lives but hangs (its main thread stuck in a call that lets its heartbeat thread run: a deadlock, a hung mount, a driver call) is not silent: `NEPS_BCAST_TRIAL_TIME_LIMIT_S` (unset by default) is what ends its trial, on every rank, and puts it back to `pending`.": (
        "tests/e2e/test_e2e_silent.py::TestATrialPastItsTimeLimitIsPutBack::test_the_hung_trial_went_back_to_pending",
        "tests/e2e/test_e2e_silent.py::TestATrialPastItsTimeLimitIsPutBack::test_no_rank_was_taken_for_silent",
        "tests/e2e/test_e2e_silent.py::TestATrialPastItsTimeLimitIsPutBack::test_the_leader_named_the_limit_and_exited_1",
    ),
    "A process is known by its host, boot id, pid namespace, pid and start time: neps_bcast signals no process but the one it means, never another container's process with the same pid number nor one that took a dead process's pid; a silent rank in another container is handled as one on another host.": (
        "tests/test_process_identity.py::test_a_process_of_another_pid_namespace_with_this_pid_is_never_signalled",
        "tests/test_process_identity.py::test_a_process_whose_start_time_changed_is_never_signalled",
        "tests/test_process_identity.py::test_the_real_process_is_signalled_through_its_identity",
        "tests/hosts/test_hosts_containers.py::TestAFrozenFollowerInAnotherContainerIsHandledAsRemote::test_the_decoy_is_alive_after_the_survivor_ended",
        "tests/hosts/test_hosts_containers.py::TestAFrozenFollowerInAnotherContainerIsHandledAsRemote::test_the_leader_ended_by_its_follower_lost_error",
        "tests/hosts/test_hosts_containers.py::TestAFrozenLeaderInAnotherContainerIsLeftToItsLease::test_the_decoy_is_alive_after_the_survivor_ended",
    ),
    "No search ends with a trial in doubt: a worker about to end waits for a trial still `evaluating` under a lease it cannot yet prove alive or dead, until it sees the lease renewed or has timed the grace period itself (then it runs the trial), never longer than `NEPS_BCAST_LEASE_GRACE_S` and a heartbeat.": (
        "tests/test_trial_in_doubt.py::test_a_worker_takes_over_a_dead_hosts_trial_before_it_ends_and_runs_it",
        "tests/test_trial_in_doubt.py::test_a_worker_whose_trial_in_doubt_is_renewed_ends_without_waiting_out_the_grace",
    ),
    "Nothing outside the job can make a rank run code: every value a rank acts on is HMAC-authenticated ([docs/security.md](docs/security.md)).": (
        "tests/e2e/test_e2e_attacker.py::TestTorchrunWithoutASecret::test_a_rank_refused_what_it_wrote_naming_the_key",
        "tests/e2e/test_e2e_attacker.py::TestLightningWithTheSameSecret::test_no_pickle_of_the_outsider_ran[full attack]",
    ),
    "`neps-bcast status` imports neither torch nor NePS and takes no lock, so it never holds up the search.": (
        "tests/test_search_status.py::test_status_imports_neither_torch_nor_neps",
        "tests/test_search_status.py::test_the_import_check_sees_torch_when_it_is_imported",
        "tests/test_search_status.py::test_status_answers_while_another_process_holds_every_lock_of_the_root",
    ),
}


def readme_guarantees() -> list[str]:
    """The bullets of README.md's "## Guarantees" section (one line each)."""
    lines = README.read_text().splitlines()
    start = lines.index("## Guarantees")
    section = []
    for line in lines[start + 1 :]:
        if line.startswith("## "):
            break
        if line.startswith("- "):
            section.append(line[2:])
    return section


def collected_ids(files: set[str]) -> set[str]:
    """The test ids pytest collects from ``files`` (``--collect-only``: nothing runs)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            *sorted(files),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=HELP_TIMEOUT_S,
        check=False,
    )
    ids = {line.strip() for line in done.stdout.splitlines() if "::" in line}
    assert ids, f"pytest collected nothing from {sorted(files)}:\n{done.stdout}\n{done.stderr}"
    return ids


def missing_tests(table: dict[str, tuple[str, ...]]) -> list[str]:
    named = {test for tests in table.values() for test in tests}
    known = collected_ids({test.split("::")[0] for test in named})
    return sorted(named - known)


def test_every_readme_guarantee_names_its_tests() -> None:
    shown = readme_guarantees()
    assert shown, "README.md has no guarantees"
    unproven = [g for g in shown if not GUARANTEES.get(g)]
    assert not unproven, (
        "README.md states guarantees with no test named for them in GUARANTEES"
        " (tests/test_docs.py): " + "; ".join(unproven)
    )
    stale = [g for g in GUARANTEES if g not in shown]
    assert not stale, f"GUARANTEES names sentences the README no longer says: {stale}"


def test_every_test_a_guarantee_names_exists() -> None:
    missing = missing_tests(GUARANTEES)
    assert not missing, "tests named in GUARANTEES that pytest does not collect: " + ", ".join(
        missing
    )


def test_a_test_that_does_not_exist_is_found_missing() -> None:
    """Positive control for the check above."""
    table = {
        "x": (
            "tests/test_search_status.py::test_status_imports_neither_torch_nor_neps",
            "tests/test_search_status.py::test_that_was_renamed_away",
        )
    }
    assert missing_tests(table) == ["tests/test_search_status.py::test_that_was_renamed_away"]
