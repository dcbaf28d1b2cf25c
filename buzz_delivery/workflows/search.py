"""The admin's run search (issue 33): terms separated by spaces, all of which a run must match,
each served by an index at millions of runs (``bench/admin_changelist.py`` measures them).

- ``tag:customer:42`` (or a bare word that is not an id prefix): the run carries that tag
  (``tags @> ARRAY[...]``, GIN ``wf_run_tags_idx``);
- ``input.order.id=42``: the run input holds that value at that path (``input @> '{"order":
  {"id": 42}}'``, GIN ``jsonb_path_ops`` ``wf_run_input_idx``); the value is JSON when it parses
  as JSON (``42``, ``true``, ``"42"``), else text;
- ``0193a5`` (2..36 hex digits and dashes): the run id starts with it (a range of the primary
  key's ``wf_run_id_idx``), a whole id is the run;
- ``state:failed``, ``workflow:<id or name>`` (``wf_run_workflow_id_idx``).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from django.db.models import Q

from buzz_delivery.models import Workflow

ID_PREFIX = re.compile(r"^[0-9a-fA-F-]{2,36}$")
HELP = (
    "Space-separated terms, all matched: tag:<tag> (or a bare word), input.<path>=<value> "
    "(JSON or text), <run id prefix>, state:<state>, workflow:<id or name>."
)


def _input_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _id_prefix(text: str) -> Q | None:
    digits = text.replace("-", "").lower()
    if not digits or len(digits) > 32 or not re.fullmatch(r"[0-9a-f]+", digits):
        return None
    if len(digits) == 32:
        return Q(pk=uuid.UUID(digits))
    shift = 4 * (32 - len(digits))
    low, high = int(digits, 16) << shift, (int(digits, 16) + 1) << shift
    bounds = Q(pk__gte=uuid.UUID(int=low))
    return bounds & Q(pk__lt=uuid.UUID(int=high)) if high < 2**128 else bounds


def term_filter(term: str) -> Q:
    """The condition one search term puts on runs."""
    if term.startswith("tag:") and len(term) > 4:
        return Q(tags__contains=[term[4:]])
    if term.startswith("state:"):
        return Q(state=term[6:])
    if term.startswith("workflow:"):
        value = term[9:]
        try:
            return Q(workflow_id=uuid.UUID(value))
        except ValueError:
            return Q(workflow_id__in=Workflow.objects.filter(name=value).values("id"))
    if term.startswith("input.") and "=" in term:
        path, _, value = term[6:].partition("=")
        parts = path.split(".")
        if all(parts):
            contained: Any = _input_value(value)
            for part in reversed(parts):
                contained = {part: contained}
            return Q(input__contains=contained)
    if ID_PREFIX.match(term) and (by_id := _id_prefix(term)) is not None:
        return by_id
    return Q(tags__contains=[term])


def run_search(text: str) -> Q:
    """The condition of a whole search (every term), ``Q()`` for an empty one."""
    condition = Q()
    for term in text.split():
        condition &= term_filter(term)
    return condition
