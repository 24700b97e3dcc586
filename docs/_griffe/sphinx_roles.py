"""A Griffe extension for the API reference: the docstrings' Sphinx roles (``:class:`X```,
``:meth:`~a.B.c```) shown as code, as Sphinx would show them, instead of as raw text; and
private base classes left out of a class's bases, since the reference does not document them."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(class|meth|func|mod|data|attr|exc|obj|const):`([^`]+)`")
CALLABLE = {"meth", "func"}


def _shown(match: re.Match[str]) -> str:
    """What Sphinx prints for one role: an explicit title, else the target (only its last part
    after ``~``; without a leading dot or ``!``), with ``()`` after a method or function."""
    role, target = match.group(1), match.group(2).strip()
    titled = re.fullmatch(r"(.+?)\s*<(.+)>", target)
    if titled:
        return f"`{titled.group(1)}`"
    target = target.lstrip("!")
    if target.startswith("~"):
        target = target[1:].rsplit(".", 1)[-1]
    target = target.lstrip(".")
    return f"`{target}()`" if role in CALLABLE and not target.endswith(")") else f"`{target}`"


def _private(base: Any) -> bool:
    name = str(base).rsplit(".", 1)[-1]
    return name.startswith("_") and not name.startswith("__")


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and ":" in obj.docstring.value:
            obj.docstring.value = ROLE.sub(_shown, obj.docstring.value)
        if isinstance(obj, griffe.Class):
            obj.bases = [base for base in obj.bases if not _private(base)]
