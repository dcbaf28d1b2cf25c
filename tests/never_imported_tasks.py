"""A module no test imports: the task worker must never import it for a stored path naming it."""

IMPORTED = True


def payload() -> str:
    return "ran"
