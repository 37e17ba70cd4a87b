"""A griffe extension for the API reference: jaxkv's ``Example:`` sections.

jaxkv's docstrings follow the house style's ``Example:`` heading (Google
style); griffe's Google parser knows the plural only, and would render the
doctest lines as Markdown (their brackets read as links). This renames the
heading as the docstrings are loaded; the source stays as written.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADING = re.compile(r"^([ \t]*)Example(?: \((.*)\))?:[ \t]*$", re.M)


def _examples(match: re.Match[str]) -> str:
    indent, title = match.group(1), match.group(2)
    return f"{indent}Examples:" + (f"\n{indent}  {title}:" if title else "")


class ExampleSections(griffe.Extension):
    """Reads each ``Example:`` (or ``Example (title):``) heading as ``Examples:``."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Renames the heading in `obj`'s docstring, if it has one."""
        del kwargs
        if obj.docstring is not None:
            obj.docstring.value = _HEADING.sub(_examples, obj.docstring.value)
