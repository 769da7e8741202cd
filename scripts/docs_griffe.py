"""A griffe extension for zerofn's site (mkdocs.yml, mkdocstrings ``extensions:``).

zerofn's docstrings are Google style with a few reStructuredText habits that Markdown
does not know: roles (:class:`~zerofn.CommPolicy`, :func:`pack_grads`, :math:`\\eta`),
``.. math::`` blocks and a paragraph ending in ``::`` before a literal block. This turns
a role into a code span (``~`` keeps the last dotted part, as Sphinx shows it), a math
block into a fenced block of its LaTeX source (no script renders math: the site loads
nothing from the network) and ``::`` into ``:``, in the docstring text only; the code
and ``help()`` are unchanged.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj|const|math):`(?P<tilde>~?)(?P<target>[^`]+)`")
_LITERAL_INTRO = re.compile(r"(?<=\S)::$", re.MULTILINE)
_LITERAL_ALONE = re.compile(r"^[ \t]*::[ \t]*$\n?", re.MULTILINE)
_MATH = re.compile(r"^(?P<indent>[ \t]*)\.\. math::(?P<first>.*)$")


def _role(match: re.Match[str]) -> str:
    target = match.group("target")
    if match.group("tilde"):
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def _math_blocks(text: str) -> str:
    """Every ``.. math::`` block (its first line and the lines indented under it) as a fenced block."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        match = _MATH.match(lines[i])
        if match is None:
            out.append(lines[i])
            i += 1
            continue
        indent, first = match.group("indent"), match.group("first").strip()
        body = [first] if first else []
        i += 1
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > len(indent)):
            body.append(lines[i].strip())
            i += 1
        while body and not body[-1]:
            body.pop()
        out += [f"{indent}```text", *(f"{indent}{line}" for line in body), f"{indent}```", ""]
    return "\n".join(out)


def markdown_docstring(text: str) -> str:
    """``text`` with roles as code spans, math blocks fenced and ``::`` literal intros as ``:``."""
    text = _math_blocks(text)
    return _LITERAL_ALONE.sub("", _LITERAL_INTRO.sub(":", _ROLE.sub(_role, text)))


class RstRolesToMarkdown(griffe.Extension):
    """Rewrites every loaded docstring with :func:`markdown_docstring`."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)
