"""The demo's closing hints name the interpreter the README installs (``.venv/bin/python``) and
its report does not wrap sentences when stdout is not a terminal (issue 17)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from project.demo.management.commands.demo import Command, make_console, python_command

ROOT = Path(__file__).resolve().parent.parent


def test_the_hints_name_the_interpreter_as_the_readme_installs_it(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "executable", str(ROOT / ".venv" / "bin" / "python"))

    assert python_command() == ".venv/bin/python manage.py"


def test_outside_the_project_folder_the_hints_name_the_absolute_interpreter(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", "/opt/py/bin/python3")

    assert python_command() == "/opt/py/bin/python3 manage.py"


@pytest.mark.django_db
def test_the_closing_hints_use_that_command(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "executable", str(ROOT / ".venv" / "bin" / "python"))
    out = io.StringIO()

    Command()._admin_hint(make_console(out), create=False)

    text = out.getvalue()
    assert ".venv/bin/python manage.py runserver" in text
    assert ".venv/bin/python manage.py createsuperuser" in text
    assert "run python manage.py" not in text


def test_the_report_does_not_wrap_a_sentence_when_not_on_a_terminal():
    out = io.StringIO()
    sentence = " ".join(["the reaper reclaimed lapsed leases from the killed worker"] * 6)

    make_console(out).print(sentence)

    assert out.getvalue() == sentence + "\n"
