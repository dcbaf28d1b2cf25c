"""The README and docs/*.md state no stale fact this suite can verify (issue 36). Each fact is
computed from the tree, never written here: a migration named or counted exists (per app), a
``manage.py`` command exists, a settings key exists in its app's ``conf.DEFAULTS`` (and every
settings table lists exactly those keys), an import in a ```python block imports, a dotted
``buzz_delivery...`` path in backticks resolves, a local link or ``examples/`` file exists, and the
wheel's file name carries the version of pyproject.toml. The README's python blocks are run by
tests/test_readme_snippets.py."""

from __future__ import annotations

import ast
import importlib
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.apps import apps
from django.core.management import get_commands

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)

# The app a page speaks of when a sentence names no other (a migration number is per app).
PAGE_APP = {
    "workflows.md": "buzz_workflows",
    "agents.md": "buzz_agents",
    "gateway.md": "buzz_gateway",
    "tasks.md": "buzz_tasks",
}
# Words a sentence uses for an app, just before "migration".
APP_WORDS = {
    "core": "buzz_delivery", "buzz_delivery": "buzz_delivery", "inbox": "buzz_delivery",
    "engine": "buzz_workflows", "engine's": "buzz_workflows",
    "workflows": "buzz_workflows", "buzz_workflows": "buzz_workflows",
    "agents": "buzz_agents", "agents'": "buzz_agents", "buzz_agents": "buzz_agents",
    "gateway": "buzz_gateway", "gateway's": "buzz_gateway", "buzz_gateway": "buzz_gateway",
    "tasks": "buzz_tasks", "buzz_tasks": "buzz_tasks",
}  # fmt: skip
NUMBER_WORDS = {
    w: i
    for i, w in enumerate(
        ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
    )
}
SETTINGS = {
    "BUZZ_DELIVERY": "buzz_delivery.conf",
    "BUZZ_WORKFLOWS": "buzz_delivery.workflows.conf",
    "BUZZ_AGENTS": "buzz_delivery.agents.conf",
    "BUZZ_GATEWAY": "buzz_delivery.gateway.conf",
}


@dataclass(frozen=True)
class Page:
    path: Path
    text: str

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT)) if self.path.is_relative_to(ROOT) else self.path.name

    def line_of(self, offset: int) -> int:
        return self.text.count("\n", 0, offset) + 1

    def prose(self) -> str:
        """The text with fenced blocks blanked (same offsets), for facts stated in sentences."""
        return FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), self.text)

    def blocks(self, *languages: str) -> list[tuple[int, str]]:
        return [(self.line_of(m.start()), m.group(2)) for m in FENCE.finditer(self.text) if m.group(1) in languages]


def pages() -> list[Page]:
    return [Page(p, p.read_text()) for p in PAGES]


def migrations() -> dict[str, list[str]]:
    """Migration names (``0001_initial``) per app label, read from the tree."""
    found = {}
    for config in apps.get_app_configs():
        if config.name == "buzz_delivery" or config.name.startswith("buzz_delivery."):
            folder = Path(config.path) / "migrations"
            found[config.label] = sorted(p.stem for p in folder.glob("[0-9][0-9][0-9][0-9]_*.py"))
    return found


def app_of(words_before: str, page: Page) -> str:
    """The app a migration mention belongs to: a word naming an app just before, else the page's."""
    for word in reversed(re.findall(r"[\w'`]+", words_before)[-2:]):
        label = APP_WORDS.get(word.strip("`").lower())
        if label:
            return label
    return PAGE_APP.get(page.path.name, "buzz_delivery")


def test_the_pages_are_found():
    # Guards the readers below: a moved README or docs folder must not leave them nothing to check.
    assert {"README.md", "workflows.md", "gateway.md", "agents.md"} <= {p.name for p in PAGES}
    assert set(migrations()) >= {"buzz_delivery", "buzz_workflows", "buzz_agents", "buzz_gateway", "buzz_tasks"}


def test_every_migration_a_page_names_exists():
    known = migrations()
    stale = []
    for page in pages():
        prose = page.prose()
        # `buzz_gateway.0001`, `buzz_workflows.0003`
        for m in re.finditer(r"\b(buzz_\w+)\.(\d{4})\b", prose):
            label, number = m.groups()
            if not any(n.startswith(number + "_") for n in known.get(label, [])):
                stale.append(f"{page.name}:{page.line_of(m.start())}: {label}.{number}")
        # "migration 0017", "core migration 0021", "migrations 0014, 0016", "migrations `buzz_workflows` 0009-0011"
        mention = re.compile(
            r"migrations?\s+(?:`?(?P<label>buzz_\w+)`?\s+)?(?P<nums>\d{4}(?:\s*(?:,|and|-|\u2013|to)\s*\d{4})*)\b", re.I
        )
        for m in mention.finditer(prose):
            label = m.group("label") or app_of(prose[max(0, m.start() - 40) : m.start()], page)
            for number in re.findall(r"\d{4}", m.group("nums")):
                if not any(n.startswith(number + "_") for n in known[label]):
                    stale.append(f"{page.name}:{page.line_of(m.start())}: {label} migration {number}")
        # `0008_holder_and_history`
        for m in re.finditer(r"`(\d{4}_\w+)`", prose):
            if not any(m.group(1) in names for names in known.values()):
                stale.append(f"{page.name}:{page.line_of(m.start())}: migration {m.group(1)}")
    assert not stale, "migrations named in the docs that the tree does not have:\n" + "\n".join(stale)


def test_every_migration_count_a_page_states_is_the_trees():
    known = migrations()
    stale = []
    count = re.compile(r"\b(?P<n>\d+|" + "|".join(NUMBER_WORDS) + r")\s+migrations?\b(?P<after>[^.\n]{0,60})", re.I)
    for page in pages():
        prose = page.prose()
        for m in count.finditer(prose):
            stated = m.group("n").lower()
            n = int(stated) if stated.isdigit() else NUMBER_WORDS[stated]
            named = re.search(r"\b(buzz_\w+)\b", m.group("after"))
            label = named.group(1) if named else app_of(prose[max(0, m.start() - 40) : m.start()], page)
            if n != len(known[label]):
                has = len(known[label])
                stale.append(f"{page.name}:{page.line_of(m.start())}: says {n} for {label}, which has {has}")
    assert not stale, "migration counts in the docs that are not the tree's:\n" + "\n".join(stale)


def test_every_management_command_a_page_names_exists():
    commands = set(get_commands())
    stale = [
        f"{page.name}:{page.line_of(m.start())}: manage.py {m.group(1)}"
        for page in pages()
        for m in re.finditer(r"manage\.py\s+([a-z][a-z0-9_]*)", page.text)
        if m.group(1) not in commands
    ]
    assert not stale, "commands the docs name that no installed app has:\n" + "\n".join(stale)


@pytest.mark.parametrize(
    ("app", "command", "page"),
    [("buzz_delivery.tasks", "run_task_worker", "tasks.md"), ("buzz_delivery.agents", "run_agent_worker", "agents.md")],
)
def test_every_option_of_a_worker_is_on_its_page(app, command, page):
    """docs/tasks.md is the task worker's page: it listed none of its options (``--poll-interval``
    was nowhere in the docs); docs/agents.md the agent worker's (each spelling of an option
    counts). Django's own options (``--settings``, ``-v``...) are left out."""
    from django.core.management import load_command_class
    from django.core.management.base import BaseCommand

    def options(command: BaseCommand) -> set[str]:
        parser = command.create_parser("manage.py", "x")
        return {o for action in parser._actions for o in action.option_strings if o.startswith("--")}

    own = options(load_command_class(app, command)) - options(BaseCommand())
    text = (ROOT / "docs" / page).read_text()
    missing = sorted(o for o in own if not re.search(rf"`{re.escape(o)}\b", text))
    assert not missing, f"options of {command} that docs/{page} does not name: {missing}"


def defaults(setting: str) -> set[str]:
    return set(importlib.import_module(SETTINGS[setting]).DEFAULTS)


def test_every_settings_key_a_page_names_exists():
    stale = []
    for page in pages():
        # BUZZ_DELIVERY["LISTEN_DATABASE"], in prose and code alike
        for m in re.finditer(r"\b(BUZZ_[A-Z]+)\[[\"'](\w+)[\"']\]", page.text):
            setting, key = m.groups()
            if setting in SETTINGS and key not in defaults(setting):
                stale.append(f"{page.name}:{page.line_of(m.start())}: {setting}[{key!r}]")
        # BUZZ_WORKFLOWS = {"LEASE_SECONDS": 60, ...} in a python block
        for line, code in page.blocks("python"):
            try:
                tree = ast.parse(code)
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
                    names = [t.id for t in node.targets if isinstance(t, ast.Name) and t.id in SETTINGS]
                    for setting in names:
                        keys = {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
                        stale += [f"{page.name}:{line}: {setting} {k!r}" for k in sorted(keys - defaults(setting))]
    assert not stale, "settings keys the docs name that the conf modules do not have:\n" + "\n".join(stale)


def settings_tables() -> list[tuple[str, str, set[str]]]:
    """(page, setting, keys) of each markdown table headed ``| key |`` whose heading or the
    paragraph above names one settings dict."""
    found = []
    for page in pages():
        for m in re.finditer(r"((?:^(?!\|).*\n){1,6})((?:^\|.*\n)+)", page.prose(), re.M):
            above, table = m.groups()
            rows = table.splitlines()
            if not re.match(r"\|\s*key\s*\|", rows[0], re.I):
                continue
            named = [s for s in SETTINGS if s in above]
            if len(named) == 1:
                keys = {k for row in rows[2:] for k in re.findall(r"^\|\s*`(\w+)`", row)}
                found.append((f"{page.name}:{page.line_of(m.start(2))}", named[0], keys))
    return found


def test_every_settings_table_lists_exactly_the_apps_keys():
    tables = settings_tables()
    assert {"BUZZ_DELIVERY", "BUZZ_GATEWAY"} <= {setting for _, setting, _ in tables}
    stale = [
        f"{where}: {setting}: not keys {sorted(keys - defaults(setting))}, missing {sorted(defaults(setting) - keys)}"
        for where, setting, keys in tables
        if keys != defaults(setting)
    ]
    assert not stale, "\n".join(stale)


def python_imports() -> list[tuple[str, str, str | None]]:
    """(where, module, name or None) of every import of the project's modules in a ```python block."""
    found = []
    for page in pages():
        for line, code in page.blocks("python"):
            try:
                tree = ast.parse(code)
            except SyntaxError as exc:
                found.append((f"{page.name}:{line}", f"<does not parse: {exc}>", None))
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    found += [(f"{page.name}:{line}", a.name, None) for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    found += [(f"{page.name}:{line}", node.module, a.name) for a in node.names if a.name != "*"]
    ours = ("buzz_delivery", "django", "project", "tests")
    return [f for f in found if f[1].startswith("<") or f[1].split(".")[0] in ours]


def test_the_python_blocks_parse_and_their_imports_import():
    imports = python_imports()
    assert len(imports) > 10
    stale = []
    for where, module, name in imports:
        try:
            imported = importlib.import_module(module)
            if name is not None and not hasattr(imported, name):
                importlib.import_module(f"{module}.{name}")
        except Exception as exc:
            stale.append(f"{where}: {module}{'' if name is None else ' ' + name}: {type(exc).__name__}: {exc}")
    assert not stale, "python blocks of the docs that do not import:\n" + "\n".join(stale)


def resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


CHECK_ID = re.compile(r"\bbuzz_\w+\.[EW]\d{3}\b")


def test_every_dotted_path_in_backticks_resolves():
    stale = [
        f"{page.name}:{page.line_of(m.start())}: {m.group(1)}"
        for page in pages()
        for m in re.finditer(r"`(buzz_delivery(?:\.[A-Za-z_]\w*)+)(?:\(\))?`", page.prose())
        if not CHECK_ID.fullmatch(m.group(1)) and not resolves(m.group(1))
    ]
    assert not stale, "dotted paths in the docs that name nothing:\n" + "\n".join(stale)


def test_every_system_check_id_a_page_names_exists():
    source = "\n".join(p.read_text() for p in (ROOT / "buzz_delivery").rglob("*.py"))
    ids = set(CHECK_ID.findall(source))
    assert len(ids) > 5
    stale = [
        f"{page.name}:{page.line_of(m.start())}: {m.group(0)}"
        for page in pages()
        for m in CHECK_ID.finditer(page.text)
        if m.group(0) not in ids
    ]
    # "buzz_delivery.E001..E010": a range's ends are ids, and the series does not go on past it (E011)
    for page in pages():
        for m in re.finditer(r"\b(buzz_\w+)\.([EW])(\d{3})\.\.(?:\1\.)?\2(\d{3})\b", page.text):
            app, kind, _first, last = m.groups()
            series = sorted(int(i[-3:]) for i in ids if i.startswith(f"{app}.{kind}"))
            if f"{app}.{kind}{last}" not in ids or any(int(last) < n < int(last) + 10 for n in series):
                stale.append(f"{page.name}:{page.line_of(m.start())}: {m.group(0)} (the ids are {series})")
    assert not stale, "system check ids the docs name that the code does not have:\n" + "\n".join(stale)


def test_every_local_link_and_example_a_page_names_exists():
    stale = []
    for page in pages():
        for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.text):
            target = m.group(1)
            if "://" not in target and not (page.path.parent / target).exists():
                stale.append(f"{page.name}:{page.line_of(m.start())}: link {target}")
        for m in re.finditer(r"\b(examples/\w+\.py|tests/[\w/]+\.py|bench/[\w/]+\.(?:py|md))\b", page.text):
            if not (ROOT / m.group(1)).exists():
                stale.append(f"{page.name}:{page.line_of(m.start())}: {m.group(1)}")
    assert not stale, "files the docs point at that do not exist:\n" + "\n".join(stale)


def test_a_wheel_named_in_the_docs_carries_the_packages_version():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    named = [
        (page.name, page.line_of(m.start()), m.group(1))
        for page in pages()
        for m in re.finditer(r"buzz_delivery-([0-9][\w.]*?)-py3", page.text)
    ]
    stale = [f"{name}:{line}: {found}" for name, line, found in named if found != version]
    assert not stale, f"wheel names in the docs whose version is not {version}:\n" + "\n".join(stale)


@pytest.mark.parametrize("fact", ["migrations", "commands", "settings"])
def test_the_checks_catch_a_stale_fact(fact, tmp_path, monkeypatch):
    """Each check above fails on a planted stale fact (a check that cannot fail is a defect)."""
    planted = {
        "migrations": "Then migrate (three migrations, `buzz_gateway.0099`).\n",
        "commands": "Run `python manage.py reap_everything`.\n",
        "settings": 'Set `BUZZ_DELIVERY["NO_SUCH_KEY"]`.\n',
    }[fact]
    page = tmp_path / "stale.md"
    page.write_text(planted)
    monkeypatch.setitem(globals(), "PAGES", [page])
    check = {
        "migrations": test_every_migration_a_page_names_exists,
        "commands": test_every_management_command_a_page_names_exists,
        "settings": test_every_settings_key_a_page_names_exists,
    }[fact]
    with pytest.raises(AssertionError):
        check()
    if fact == "migrations":
        with pytest.raises(AssertionError):
            test_every_migration_count_a_page_states_is_the_trees()
