"""griffe extension: reStructuredText roles in lppo's docstrings become cross-reference links.

lppo's docstrings are Google style with Sphinx roles (``:class:`~lppo.tasks.Task```,
``:meth:`finish```) and double back-quoted literals. mkdocstrings renders Markdown, where those
would show as raw text; this extension rewrites each role as an optional autorefs link
(``<autoref identifier="lppo.tasks.Task" optional><code>Task</code></autoref>``: a link where
the target is documented, plain code where it is not) and each literal as Markdown code.
``lppo settings`` and ``--help`` turn the same roles into plain text
(:func:`lppo.run.rst.rst_to_text`).
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

from lppo.run.rst import rewrite_roles

#: A dotted Python name (anything else is shown as code, not linked).
IDENTIFIER = re.compile(r"[A-Za-z_][\w.]*")


def _link(title: str, target: str) -> str:
    code = f"<code>{html.escape(title)}</code>"
    if not IDENTIFIER.fullmatch(target):
        return code
    return f'<autoref identifier="{target}" optional>{code}</autoref>'


def to_markdown(text: str) -> str:
    """``text`` with every role as an optional autorefs link and literals as code."""
    return rewrite_roles(text, _link, lambda content: f"`{content}`")


class RstRoles(griffe.Extension):
    """Rewrite the docstring of every object griffe loads (:func:`to_markdown`)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring in place.

        Args:
            obj: the object griffe just built.
            **kwargs: griffe's other arguments (unused).
        """
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
