"""The documentation agrees with the repository: links resolve and commands parse.

Which files: ``README.md``, ``CHANGELOG.md``, ``benchmarks/RESULTS.md`` and every
``docs/*.md``.

Links. Every relative link, inline (``[text](target)``, ``![alt](target)``) or by reference
(``[label]: target``), outside code (fenced blocks and inline code spans are skipped), must
name a file or folder that exists, inside the repository (a link that climbs out of it, such
as one to ``../shared/``, fails even where that path exists on this machine). A link with an
``#anchor`` into a Markdown file (or into its own file: ``#anchor`` alone) must name one of
that file's headings, slugged as GitHub slugs them: the heading's text without its inline
markup, lower-cased, every character that is not a letter, digit, space, ``-`` or ``_``
dropped, spaces turned into ``-``, and ``-1``, ``-2``, ... appended to repeats. Anchors into
other files (``file.py#L10``) are not checked. Links with a scheme (``https:``, ``mailto:``)
are not followed.

Commands. In README.md and docs/*.md, every fenced code block that is shell (no language
tag, or ``bash``, ``sh``, ``shell``, ``console``) is read line by line: a trailing ``\\``
joins the next line, a leading ``$ `` prompt and a ``# comment`` are dropped, and the line is
split as the shell splits words, then cut at ``&&``, ``||``, ``;``, ``|`` and ``&``. Each
piece whose program is ``phasewise`` (or a path ending in ``/phasewise``) is handed, without
its program name, to ``phasewise.cli.parse_args``, the parser the ``phasewise`` command
itself uses; nothing is run. A piece the parser refuses (an unknown command or flag, a
value of the wrong type, a choice that does not exist, a missing argument) fails the test.

Placeholders. A piece that holds a placeholder is not parsed, since its values are not real:
a word in angle brackets (``<task>``, ``--model <dir>``) or an ellipsis (``...`` or ``…``).
For such a piece the command must still exist and every ``--flag`` in it must be one that
command's parser defines, spelled in full, so a renamed or removed flag still fails.
Placeholders written in capitals (``FILE``, ``DIR``) are plain words to the parser: use them
only where the flag takes a string.

Nothing here times anything or starts a server; building the parser imports no torch.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import unicodedata
from pathlib import Path

import pytest

from phasewise import cli

ROOT = Path(__file__).resolve().parent.parent
SHELL_LANGS = {"", "bash", "sh", "shell", "console", "zsh"}
OPERATORS = {"&&", "||", ";", "|", "&"}
# A line that may run phasewise: the program at the start or after a shell operator.
CANDIDATE = re.compile(r"(?:^|[;&|]\s*)(?:\S*/)?phasewise(?:\s|$)")
PLACEHOLDER = re.compile(r"<[^<>\s]+>|\.\.\.|…")


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "RESULTS.md"]
    return files + sorted((ROOT / "docs").glob("*.md"))


def command_doc_files() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


# --- Markdown reading -------------------------------------------------------------------------

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)")


def split_fences(text: str) -> tuple[list[str], list[tuple[str, list[tuple[int, str]]]]]:
    """The text's lines outside fenced blocks (blanked inside them, so line numbers hold),
    and each fenced block as (language, [(line number, line)])."""
    prose: list[str] = []
    blocks: list[tuple[str, list[tuple[int, str]]]] = []
    fence = None
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            blocks.append((m.group(2).lower(), []))
            prose.append("")
        elif fence is not None and line.strip().startswith(fence[0] * len(fence)) \
                and line.strip().strip(fence[0]) == "":
            fence = None
            prose.append("")
        elif fence is not None:
            blocks[-1][1].append((n, line))
            prose.append("")
        else:
            prose.append(line)
    return prose, blocks


INLINE_CODE = re.compile(r"(`+)(.+?)\1")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]"  # [text], one level of [] inside
                         r"\(\s*<?([^\s)<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # (target "title")
REF_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link outside code."""
    prose, _ = split_fences(text)
    found = []
    for n, line in enumerate(prose, 1):
        line = INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)
        found += [(n, m.group(1)) for m in INLINE_LINK.finditer(line)]
        m = REF_LINK.match(line)
        if m:
            found.append((n, m.group(1)))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before de-duplication)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = text.replace("`", "")
    text = re.sub(r"(\*\*|__|\*)", "", text)  # emphasis markers
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    out = []
    for ch in text.strip().lower():
        cat = unicodedata.category(ch)
        if ch in " -_" or cat[0] in "LN":
            out.append("-" if ch == " " else ch)
    return "".join(out)


def anchors(text: str) -> set[str]:
    prose, _ = split_fences(text)
    seen: dict[str, int] = {}
    result = set()
    for line in prose:
        m = re.match(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(2))
        k = seen.get(base, 0)
        seen[base] = k + 1
        result.add(base if k == 0 else f"{base}-{k}")
    return result


def link_errors(path: Path, text: str) -> list[str]:
    errors = []
    for n, target in links(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
            continue  # https:, mailto:, ...
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{n}"
        file_part, _, anchor = target.partition("#")
        if not file_part:  # an anchor in this very file
            if anchor not in anchors(text):
                errors.append(f"{where}: {target}: no heading with anchor #{anchor}")
            continue
        dest = (path.parent / file_part).resolve()
        if not dest.is_relative_to(ROOT):
            errors.append(f"{where}: {target} leaves the repository")
            continue
        if not dest.exists():
            errors.append(f"{where}: {target} does not exist")
            continue
        if anchor and dest.suffix == ".md":
            if anchor not in anchors(dest.read_text(encoding="utf-8")):
                errors.append(f"{where}: {target}: no heading with anchor #{anchor}")
    return errors


# --- Commands ---------------------------------------------------------------------------------

def command_lines(text: str) -> list[tuple[int, str]]:
    """(line number, logical line) of the shell blocks, continuations joined."""
    _, blocks = split_fences(text)
    out = []
    for lang, lines in blocks:
        if lang not in SHELL_LANGS:
            continue
        pending, start = "", 0
        for n, line in lines:
            if not pending:
                start = n
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            out.append((start, pending + line))
            pending = ""
        if pending:
            out.append((start, pending))
    return out


def phasewise_pieces(line: str) -> list[list[str]]:
    """The argument lists (program name left out) of the phasewise commands on a line."""
    line = line.strip()
    if line.startswith("$ "):
        line = line[2:]
    if not CANDIDATE.search(line):
        return []
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        words = list(lexer)
    except ValueError as e:  # an unbalanced quote
        return [["<unparsable>", str(e)]]
    pieces, current = [], []
    for w in words:
        if w in OPERATORS:
            pieces.append(current)
            current = []
        else:
            current.append(w)
    pieces.append(current)
    return [p[1:] for p in pieces
            if p and (p[0] == "phasewise" or p[0].endswith("/phasewise"))]


def subcommand_parser(argv: list[str]) -> argparse.ArgumentParser | None:
    if argv[:2] == ["bench", "report"]:
        return cli.build_report_parser()
    parser = cli.build_parser()
    words = [w for w in argv if not w.startswith("-")]
    if not words:
        return None
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(words[0])
    return None


def command_error(argv: list[str]) -> str | None:
    """Why the phasewise parser refuses ``argv`` (None: it takes it)."""
    if argv[:1] == ["<unparsable>"]:
        return argv[1]
    if any(PLACEHOLDER.search(w) for w in argv):
        sub = subcommand_parser(argv)
        if sub is None:
            return "no such command"
        known = set(sub._option_string_actions)
        bad = [w.split("=")[0] for w in argv
               if w.startswith("--") and w.split("=")[0] not in known]
        return f"unknown flags {bad}" if bad else None
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            cli.parse_args(argv)
    except SystemExit as e:
        if e.code not in (0, None):
            return err.getvalue().strip().splitlines()[-1] if err.getvalue() else f"exit {e.code}"
    return None


def command_errors(path: Path, text: str) -> list[str]:
    errors = []
    for n, line in command_lines(text):
        for argv in phasewise_pieces(line):
            why = command_error(argv)
            if why:
                rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                errors.append(f"{rel}:{n}: phasewise {' '.join(argv)}: {why}")
    return errors


# --- The tests --------------------------------------------------------------------------------

def test_the_documentation_files_exist():
    for name in ("README.md", "CHANGELOG.md", "benchmarks/RESULTS.md", "docs/architecture.md"):
        assert (ROOT / name).is_file(), name


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    errors = link_errors(path, path.read_text(encoding="utf-8"))
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("path", command_doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_commands_parse(path):
    errors = command_errors(path, path.read_text(encoding="utf-8"))
    assert not errors, "\n".join(errors)


def test_the_readme_names_some_commands():
    """The command check has something to check: the README's tour runs phasewise."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    names = {argv[0] for _, line in command_lines(text) for argv in phasewise_pieces(line)
             if argv}
    assert {"generate", "serve", "bench", "roofline", "pd", "plan"} <= names


def test_the_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    _, blocks = split_fences(readme)
    commands = {line.strip() for _, lines in blocks for _, line in lines}
    assert "bash scripts/test.sh" in commands
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "exec bash scripts/test.sh" in ci.splitlines()


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 300


def test_no_document_points_outside_the_repository():
    for path in doc_files():
        assert "../shared/" not in path.read_text(encoding="utf-8"), path


# --- The checks themselves can fail -----------------------------------------------------------

def test_the_link_check_catches_missing_files_anchors_and_escapes():
    doc = ROOT / "docs" / "example.md"  # not written: only its location is used
    text = ("# A heading\n\n[ok](../README.md) [self](#a-heading) [gone](missing.md)\n"
            "[bad anchor](../README.md#no-such-heading) [out](../../elsewhere.md)\n"
            "`[in code](missing.md)`\n\n```\n[in a block](missing.md)\n```\n"
            "[web](https://example.com/x.md) [bad self](#no-heading)\n")
    errors = link_errors(doc, text)
    assert len(errors) == 4, errors
    assert any("missing.md does not exist" in e for e in errors)
    assert any("#no-heading" in e for e in errors)
    assert any("no-such-heading" in e for e in errors)
    assert any("leaves the repository" in e for e in errors)


def test_slugs_follow_githubs_rules():
    text = ("# Serving\n## The `phasewise bench` tool\n## P/D: when?\n## Serving\n"
            "## What x1.5 means, *roughly*\n")
    assert anchors(text) == {"serving", "the-phasewise-bench-tool", "pd-when", "serving-1",
                             "what-x15-means-roughly"}


def test_the_command_check_catches_unknown_flags_and_bad_values():
    text = ("```bash\n"
            "phasewise serve --port 8001                 # fine\n"
            "phasewise serve --no-such-flag\n"
            ".venv/bin/phasewise serve --port eighty\n"
            "phasewise roofline --model <dir> --not-a-flag 1\n"
            "phasewise no-such-command\n"
            "curl localhost:8000 && phasewise generate \\\n"
            "    --policy sideways \"x\"\n"
            "phasewise bench report a.json -o r.html\n"
            "phasewise plan --model <dir> --budgets 64 ...\n"
            "```\n"
            "```python\nphasewise serve --not-checked-in-python\n```\n")
    errors = command_errors(ROOT / "docs" / "example.md", text)
    assert len(errors) == 5, errors
    joined = "\n".join(errors)
    for piece in ("--no-such-flag", "eighty", "--not-a-flag", "no-such-command", "sideways"):
        assert piece in joined
