"""Every `peagle ...` command written in the README's and docs' code blocks parses with today's command line (a
renamed or dropped flag breaks the documented command, and this test). Lines with placeholders the reader fills in
(`...`, `$VAR`, `[--optional flag]`) are illustrations, not commands, and are left out."""
from __future__ import annotations

import glob
import os
import re
import shlex

import pytest

from peagle.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def documented_commands(paths) -> list[tuple[str, str]]:
    """(file, command line) of each `peagle` line in the files' fenced code blocks (continuations joined: a
    trailing backslash, or a quote still open; a trailing `# comment` and a `$ ` prompt dropped), placeholder
    lines left out."""
    out = []
    for fn in paths:
        with open(fn) as f:
            text = f.read()
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
            lines = [x.strip().removeprefix("$ ") for x in block.replace("\\\n", " ").splitlines()]
            for i, line in enumerate(lines):
                if not line.startswith("peagle "):
                    continue
                while not _closed(line) and i + 1 < len(lines):       # a quoted argument over several lines
                    i += 1
                    line += " " + lines[i]
                line = line.split("  #")[0].strip()
                if not re.search(r"\.\.\.|\$[A-Z{(]|\[--", line):
                    out.append((os.path.relpath(fn, ROOT), line))
    return out


def _closed(line: str) -> bool:
    try:
        shlex.split(line)
        return True
    except ValueError:
        return False


DOCS = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
COMMANDS = documented_commands(DOCS)


def test_the_docs_hold_commands_to_check():
    assert len(COMMANDS) >= 25, COMMANDS                              # not passing on an empty list
    assert any(f == "README.md" for f, _ in COMMANDS)


@pytest.mark.parametrize("where,line", COMMANDS, ids=[f"{f}:{c.split()[1]}" for f, c in COMMANDS])
def test_a_documented_command_parses(where, line):
    try:
        build_parser().parse_args(shlex.split(line)[1:])
    except SystemExit as e:
        pytest.fail(f"{where}: `{line}` does not parse (exit {e.code})")


def test_a_command_with_a_flag_that_does_not_exist_is_caught(tmp_path):
    """Negative control: a doc whose command names an unknown flag is found and fails to parse."""
    doc = tmp_path / "doc.md"
    doc.write_text("```bash\npeagle generate --prompt hi --max-tokenz 5   # a typo\n```\n")
    [(_, line)] = documented_commands([str(doc)])
    with pytest.raises(SystemExit):
        build_parser().parse_args(shlex.split(line)[1:])
