"""``option``: a documented dataclass field, from which the command line derives one flag; and the
small checks the groups share."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def option(default: Any, help: str, section: str, metavar: str | None = None, comma_separated: bool = False) -> Any:
    """A documented dataclass field; the command line derives one flag from each (``cli.add_options``).

    Its metadata holds ``help`` (what the option does), ``section`` (the group ``--help`` lists it
    under) and, where they differ from the defaults, the flag's ``metavar`` (else the type's name) and
    ``comma_separated`` (a tuple option whose words are also split at commas).
    """
    metadata: dict[str, Any] = {"help": help, "section": section}
    if metavar is not None:
        metadata["metavar"] = metavar
    if comma_separated:
        metadata["comma_separated"] = True
    return field(default=default, metadata=metadata)


def at_least(options: object, low: int | float, *names: str) -> None:
    """Raise ValueError naming the first of ``names`` whose value (None passes) is below ``low``."""
    for name in names:
        value = getattr(options, name)
        if value is not None and value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
