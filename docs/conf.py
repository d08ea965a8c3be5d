"""Sphinx configuration of the areal_jax documentation (Markdown pages read by MyST).

Built by `make docs` and by tests/test_docs.py with warnings as errors, so a broken link, a page
missing from every toctree or a docstring autodoc cannot render fails the build.
"""

import os
import sys

# The package is installed editable by `make install`; the path also lets a bare checkout build.
sys.path.insert(0, os.path.abspath(".."))
# Importing areal_jax imports JAX: keep it on the CPU whatever the machine building the docs has.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "areal_jax"
author = "areal_jax developers"
copyright = "areal_jax developers"  # pylint: disable=redefined-builtin

extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]

# MyST: anchors for headings (links like page.md#section), fenced `{directive}` blocks, colon fences.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist", "dollarmath"]

# autodoc: the public API only, in source order, signatures as written.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"

html_theme = "furo"
html_title = "areal_jax"
html_static_path = []
