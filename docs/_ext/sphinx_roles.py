"""Griffe extension for the docs build: Sphinx roles in docstrings become links.

The library's docstrings cross-reference with Sphinx roles (``:func:`register```,
``:class:`~pointalign.RegistrationResult```, ``:meth:`.save```), which Markdown shows as
literal text. On every object this rewrites them into mkdocs-autorefs references that
resolve in the object's scope (its module's names and imports, as Python would) and
render as code: linked where the target is documented on the site, plain code otherwise
(the reference is optional, so ``mkdocs build --strict`` never fails on one). Loaded by
``mkdocs.yml`` (``extensions:`` of the python handler); not part of the site.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|data|attr|exc|obj|const|type)"
                  r":`(?P<body>[^`]+)`")


def _target(body: str) -> tuple[str, str]:
    """(label, name) of a role's body: ``~a.b`` shows ``b``; ``title <a.b>`` shows title."""
    m = re.fullmatch(r"\s*(?P<title>.*?)\s*<(?P<name>[^>]+)>\s*", body)
    if m:
        return m["title"], m["name"].strip()
    body = body.strip()
    if body.startswith("~"):
        name = body[1:]
        return name.rsplit(".", 1)[-1], name
    return body, body


def _resolve(obj: Any, name: str) -> str | None:
    """The full path of ``name`` seen from ``obj`` (None when it cannot be told)."""
    name = name.lstrip(".")
    if name.startswith("pointalign."):
        return name
    head, _, rest = name.partition(".")
    try:
        path = obj.resolve(head)
    except Exception:  # NameResolutionError, alias errors: leave it unlinked
        return None
    return f"{path}.{rest}" if rest else path


def _rewrite(text: str, obj: Any) -> str:
    def one(m: re.Match[str]) -> str:
        label, name = _target(m["body"])
        code = f"<code>{html.escape(label.rstrip('()'))}{'()' if label.endswith('()') else ''}" \
               "</code>"
        path = _resolve(obj, name)
        if path is None:
            return code
        return f'<autoref identifier="{html.escape(path)}" optional>{code}</autoref>'

    return ROLE.sub(one, text)


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx cross-reference roles in every docstring (see the module docstring)."""

    def on_object(self, *, obj: Any, **kwargs: Any) -> None:  # noqa: D102
        doc = getattr(obj, "docstring", None)
        if doc is not None and ":" in doc.value and "`" in doc.value:
            doc.value = _rewrite(doc.value, obj)
