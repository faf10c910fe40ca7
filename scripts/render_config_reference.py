"""Writes docs/config.md, the configuration reference, from the config schema.

    python scripts/render_config_reference.py [--out docs/config.md]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from loongsage.config_reference import render_reference

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/config.md")
    out = Path(ap.parse_args().out)
    out.write_text(render_reference())
    print(out)
