"""Tables of test cases written one case a line, as a shell command line is written."""

from __future__ import annotations

import shlex


def shell_cases(table: str) -> list[list[str]]:
    """The rows of a case table, one case a line split as a POSIX shell splits a command
    line: a field with spaces or quotes stands in double quotes (``"name=''"`` is the one
    field name=''), and so does each row's last field, the message fragment. Blank lines
    and # comments are skipped."""
    rows = [line.strip() for line in table.splitlines()]
    return [shlex.split(row) for row in rows if row and not row.startswith("#")]
