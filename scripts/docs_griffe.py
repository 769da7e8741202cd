"""A griffe extension for zerofn's site (mkdocs.yml, mkdocstrings ``extensions:``).

zerofn's docstrings are Google style with a few reStructuredText habits that Markdown
does not know: roles (:class:`~zerofn.CommPolicy`, :func:`pack_grads`, :math:`\\eta`) and
a paragraph ending in ``::`` before a literal block. This turns a role into a code span
(``~`` keeps the last dotted part, as Sphinx shows it) and ``::`` into ``:``, in the
docstring text only; the code and ``help()`` are unchanged.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj|const|math):`(?P<tilde>~?)(?P<target>[^`]+)`")
_LITERAL_INTRO = re.compile(r"(?<=\S)::$", re.MULTILINE)
_LITERAL_ALONE = re.compile(r"^[ \t]*::[ \t]*$\n?", re.MULTILINE)


def _role(match: re.Match[str]) -> str:
    target = match.group("target")
    if match.group("tilde"):
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def markdown_docstring(text: str) -> str:
    """``text`` with reStructuredText roles as code spans and ``::`` literal intros as ``:``."""
    return _LITERAL_ALONE.sub("", _LITERAL_INTRO.sub(":", _ROLE.sub(_role, text)))


class RstRolesToMarkdown(griffe.Extension):
    """Rewrites every loaded docstring with :func:`markdown_docstring`."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)
