"""Renders docs/recipes.md from validated run directories (see loongsage/validation/render.py).

    python scripts/render_recipes_doc.py RUN_DIR [RUN_DIR ...] [--out docs/recipes.md]
"""
from __future__ import annotations

import argparse

from loongsage.validation.render import render

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", help="run directories that `loongsage validate` has checked")
    ap.add_argument("--out", default="docs/recipes.md")
    print(render(**vars(ap.parse_args())))
