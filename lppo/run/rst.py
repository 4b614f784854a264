"""reStructuredText roles in lppo's docstrings, read in one place and rendered per reader.

lppo's docstrings are written for the documentation site, with Sphinx roles
(``:class:`~lppo.tasks.Task```) and double-back-quoted literals. ``lppo fit --help`` and
``lppo settings`` show them as plain text (:func:`rst_to_text`); the site's hooks
(``docs/hooks``) as links and code, through the same :func:`rewrite_roles`.
"""

from __future__ import annotations

import re
from collections.abc import Callable

#: A role (``:class:`~a.b.C```, ``:py:meth:`x```, ``:meth:`title <a.b.c>```): its ``~`` and
#: its target.
ROLE = re.compile(r":(?:py:)?[a-z]+:`(~?)([^`]+)`")
#: A double-back-quoted literal.
LITERAL = re.compile(r"``([^`]+)``")


def rewrite_roles(text: str, role: Callable[[str, str], str], literal: Callable[[str], str]) -> str:
    """``text`` with each reStructuredText role and literal rewritten.

    The one reader of the roles lppo's docstrings use: ``--help`` and ``lppo settings``
    (:func:`rst_to_text`) and the documentation site's hooks render them through it.

    Args:
        text: a docstring or help text.
        role: ``(title, target) -> replacement``; the title is the target's last part for
            ``~a.b.C``, the given one for ``title <a.b.C>``, else the whole target.
        literal: ``content -> replacement`` for a double-back-quoted literal.
    """

    def one(match: re.Match[str]) -> str:
        tilde, target = match.groups()
        explicit = re.fullmatch(r"(.+?)\s*<([^>]+)>", target)
        if explicit:
            return role(explicit.group(1), explicit.group(2))
        return role(target.rsplit(".", 1)[-1] if tilde else target, target)

    return LITERAL.sub(lambda m: literal(m.group(1)), ROLE.sub(one, text))


def rst_to_text(text: str) -> str:
    """``text`` with roles and literals as plain text (``:class:`~lppo.tasks.Task``` → Task)."""
    return rewrite_roles(text, lambda title, _: title, lambda content: content)
