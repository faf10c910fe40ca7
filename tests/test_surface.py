"""The CLI and config surface, frozen: every subcommand's flags and every config key's type and
default, compared with a checked-in snapshot. A change to the surface must update the snapshot on
purpose (and the docs with it):

    LOONGSAGE_UPDATE_SURFACE=1 .venv/bin/python -m pytest tests/test_surface.py
"""
from __future__ import annotations

import argparse
import difflib
import os
from pathlib import Path

from helpers import fresh_python
from loongsage.cli import build_parser
from loongsage.config_reference import config_keys

SNAPSHOT = Path(__file__).parent / "snapshots" / "surface.txt"


def _cli_lines(parser: argparse.ArgumentParser, prefix: str) -> list[str]:
    lines = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in sorted(action.choices.items()):
                lines += _cli_lines(sub, f"{prefix} {name}")
        elif not isinstance(action, argparse._HelpAction):
            flags = "/".join(action.option_strings) or action.dest
            default = "" if action.default in (None, argparse.SUPPRESS) else f" = {action.default!r}"
            lines.append(f"{prefix}: {flags}{' (required)' if action.required else ''}{default}")
    return lines


def _config_lines() -> list[str]:
    return [f"{k.key}: {k.type} = {k.default!r}" for k in config_keys()]


def surface() -> str:
    return "\n".join(["# CLI"] + _cli_lines(build_parser(), "loongsage") + ["", "# config"]
                     + _config_lines()) + "\n"


def test_cli_and_config_surface_match_the_snapshot():
    now = surface()
    if os.environ.get("LOONGSAGE_UPDATE_SURFACE"):
        SNAPSHOT.write_text(now)
    frozen = SNAPSHOT.read_text()
    diff = "".join(difflib.unified_diff(frozen.splitlines(True), now.splitlines(True), "snapshot", "code"))
    assert now == frozen, ("the CLI or config surface changed; if on purpose, update the snapshot "
                           f"(LOONGSAGE_UPDATE_SURFACE=1) and the docs:\n{diff}")


def test_importing_the_config_pulls_in_neither_torch_nor_transformers():
    heavy = fresh_python("import json, sys, loongsage.config, loongsage.cli; loongsage.cli.build_parser(); "
                         "print(json.dumps(sorted(m for m in ('torch', 'transformers', 'ray', 'numpy') "
                         "if m in sys.modules)))", timeout=120)
    assert heavy == []


def test_the_package_import_graph_is_acyclic():
    """Every import between LoongSage's packages and top-level modules (run-time or not) points
    one way: no two of them depend on each other, directly or through others."""
    import ast

    root = Path(__file__).parents[1] / "loongsage"
    edges: dict[str, set[str]] = {}
    for f in root.rglob("*.py"):
        src = f.relative_to(root).parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for name in names:
                parts = name.split(".")
                if parts[0] == "loongsage" and len(parts) > 1 and parts[1] != src:
                    edges.setdefault(src, set()).add(parts[1])

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return any(n == b or (n not in seen and reaches(n, b, seen | {n})) for n in edges.get(a, ()))
    cycles = sorted({tuple(sorted((a, b))) for a in edges for b in edges[a] if reaches(b, a, {b})})
    assert not cycles, f"packages that depend on each other: {cycles}"
