"""User-facing errors: the CLI prints their message on one line and exits with code 2."""


class UserError(ValueError):
    """Bad input from the user (unknown name, impossible shape, malformed file).

    The message must name the offending value and, for unknown names, the valid ones.
    """


def unknown_name(kind: str, name: str, valid: list[str] | tuple[str, ...]) -> UserError:
    """An error for an unknown preset/config/GPU name that lists the valid ones."""
    return UserError(f"unknown {kind} {name!r}; valid: {', '.join(sorted(valid))}")
