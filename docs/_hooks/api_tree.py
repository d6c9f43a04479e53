"""MkDocs hook: lay the sources out under their import names, for mkdocstrings.

headrace installs ``stream/`` as ``headrace``, ``readers/`` as ``headrace.readers`` and ``ops/`` as
``headrace.ops`` (``package-dir`` in pyproject.toml). griffe, which reads the sources for the API
pages, finds a package by its folder's name, so it finds none of these; and when mkdocs runs as
the ``.venv/bin/mkdocs`` script, the ``headrace`` console script beside it is taken for a package.
This hook mirrors the mapping as folders of links to the ``.py`` files, in ``build/docs-api/``,
each time mkdocs loads its config (so ``mkdocs serve`` sees files added since), and mkdocs.yml
points mkdocstrings' ``paths`` there. Warnings about docstrings name files under that folder:
``build/docs-api/headrace/_loader.py`` is ``stream/_loader.py``.

On the API page it drops the reST literal-block marker ``::`` that some docstrings use before
an indented example (the example itself renders as code; a paragraph ending in ``::`` keeps one
colon, as in reST).

It also warns (so a strict build fails) about a name in a package's ``__all__`` that docs/api.md
neither renders (``::: headrace.ops.Pipeline``) nor mentions (`` `IMAGENET_MEAN` ``): the API
page is grouped by hand, and a new public name belongs in it.
"""

from __future__ import annotations

import ast
import logging
import re
import shutil
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREE = ROOT / "build" / "docs-api"
log = logging.getLogger(f"mkdocs.hooks.{__name__}")


def package_dirs() -> dict[str, str]:
    """The import name -> source folder mapping of pyproject.toml's ``[tool.setuptools] package-dir``."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


def mirror(src: Path, dest: Path) -> None:
    """Link every .py file under ``src`` into the same place under ``dest``, making real folders."""
    for path in src.rglob("*.py"):
        rel = path.relative_to(src)
        if "__pycache__" in rel.parts:
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).symlink_to(path)


def build_tree() -> None:
    shutil.rmtree(TREE, ignore_errors=True)
    # Outer packages first: an inner one (headrace.readers) lands inside the outer one's folder.
    for name, folder in sorted(package_dirs().items(), key=lambda item: item[0].count(".")):
        mirror(ROOT / folder, TREE.joinpath(*name.split(".")))


def public_names(init: Path) -> list[str]:
    """The names in an ``__init__.py``'s ``__all__``, read from its source (nothing is imported)."""
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    if page.file.src_uri == "api.md":
        for name, folder in package_dirs().items():
            for public in public_names(ROOT / folder / "__init__.py"):
                if not any(f"{form}" in markdown for form in (f"::: {name}.{public}\n", f"`{public}`", f"`{name}.{public}`")):
                    log.warning("api.md does not document %s.%s (in %s/__init__.py's __all__)", name, public, folder)
    return markdown


def on_page_content(html: str, page, **kwargs) -> str:
    if page.file.src_uri == "api.md":
        html = re.sub(r"<p>::</p>\s*", "", html)
        html = re.sub(r"::</p>", ":</p>", html)
    return html


build_tree()
