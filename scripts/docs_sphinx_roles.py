"""Griffe extension for the documentation site (mkdocs.yml): Sphinx cross-reference roles in
the docstrings become mkdocstrings cross-references.

The docstrings are numpy style, and their cross-references are written the Sphinx way
(``:class:`~dpu_pipe.Loader```, ``:meth:`state_dict```). mkdocstrings renders Markdown, where
those roles would show as raw text. This extension rewrites each role, before the docstring is
parsed, into an autorefs element:

- the target is resolved the way Sphinx resolves it: a dotted path from ``dpu_pipe``, or a
  name relative to the object that carries the docstring, then to its class, its module (whose
  imports count) and the package root;
- a target found in the package becomes an *optional* cross-reference to its canonical path:
  a link where the site renders that object, the name in code (with the full path as its
  tooltip) where it does not;
- a target not found (outside the package, or a misspelt name) is rendered as code.

Sphinx's display rules are kept: ``~a.b.c`` shows ``c``, ``Title <a.b.c>`` shows ``Title``.
Nothing in the package's sources changes; only the text given to the docstring parser does.
"""

import html
import re

import griffe

__all__ = ["SphinxRoles"]

ROLE = re.compile(
    r":(?:py:)?(?P<role>class|func|meth|mod|attr|data|exc|obj|const):"
    r"`(?P<body>[^`]+)`"
)
TITLED = re.compile(r"^(?P<title>.*?)\s*<(?P<target>[^<>]+)>$", re.DOTALL)
PACKAGE = "dpu_pipe"


def _lookup(collection, path):
    """The object at dotted ``path`` in the loaded modules, or None."""
    try:
        return collection[path]
    except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


def _canonical(found):
    """The path the object is defined at (an alias followed to its target), or None when the
    alias points outside what was loaded."""
    try:
        return found.canonical_path
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


def resolve(obj, target, collection):
    """Canonical dotted path of ``target`` as seen from ``obj``'s docstring, or None."""
    target = target.lstrip(".")
    if not target:
        return None
    candidates = []
    if target.split(".")[0] == PACKAGE:
        candidates.append(target)
    scope = obj
    while scope is not None:
        candidates.append(f"{scope.path}.{target}")
        scope = scope.parent
    candidates.append(f"{PACKAGE}.{target}")
    for path in candidates:
        found = _lookup(collection, path)
        if found is not None:
            return _canonical(found)
    return None


def rewrite(text, obj, collection):
    """``text`` with every Sphinx role replaced (see the module docstring)."""

    def replace(match):
        body = match["body"].strip()
        titled = TITLED.match(body)
        if titled:
            title, target = titled["title"], titled["target"].strip()
        else:
            target = body.lstrip("~")
            title = target.rsplit(".", 1)[-1] if body.startswith("~") else target
        code = f"<code>{html.escape(title)}</code>"
        path = resolve(obj, target, collection)
        if path is None:
            return code
        return f'<autoref identifier="{html.escape(path, quote=True)}" optional>{code}</autoref>'

    return ROLE.sub(replace, text)


class SphinxRoles(griffe.Extension):
    """Rewrites the Sphinx roles of every docstring in the loaded package."""

    def on_package(self, *, pkg, loader, **kwargs):
        collection = loader.modules_collection
        seen = set()

        def visit(obj):
            if id(obj) in seen:
                return
            seen.add(id(obj))
            if obj.docstring is not None and ":" in obj.docstring.value:
                obj.docstring.value = rewrite(obj.docstring.value, obj, collection)
            for member in obj.members.values():
                if not member.is_alias:
                    visit(member)

        visit(pkg)
