"""Every ```python block of README.md runs as written, in order, against the test database
(issue 17): a newcomer copies them, so a snippet that calls something it never defines, or
cannot be parsed, fails here."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def python_blocks() -> list[tuple[int, str]]:
    """(line number, code) of each ```python block of the README."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in BLOCK.finditer(text)]


def test_the_readme_has_python_snippets_to_run():
    # Guards the extraction: a changed fence must not leave the runner below with nothing to run.
    assert len(python_blocks()) >= 3


@pytest.mark.django_db
@pytest.mark.parametrize(("line", "code"), python_blocks(), ids=[f"README.md:{n}" for n, _ in python_blocks()])
def test_a_readme_snippet_runs_as_written(line, code):
    out = io.StringIO()
    namespace: dict[str, object] = {"__name__": f"readme_line_{line}"}

    with contextlib.redirect_stdout(out):
        exec(compile(code, f"README.md:{line}", "exec"), namespace)

    if "work_once(" in code:  # the end-to-end snippet says what happened
        assert "settled finished" in out.getvalue()
