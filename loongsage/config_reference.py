"""Every config key with its type, default and description, read from the schema itself: the
frozen surface (`tests/test_surface.py`) and the generated reference page `docs/config.md`
(`python scripts/render_config_reference.py`) come from here, so neither can drift from the code."""
from __future__ import annotations

import re
import typing
from dataclasses import dataclass

from pydantic import BaseModel

from loongsage.config import RunConfig


@dataclass
class Key:
    key: str  # dotted; `[]` marks the items of a list of sections (data_sources[].name)
    type: str
    default: object
    description: str


def type_name(annotation) -> str:
    text = str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return re.sub(r"Annotated\[str, (plugin\(\w+\)), AfterValidator\(func=<function [^)]+>\)\]", r"\1", text)


def config_keys(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[Key]:
    out = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out += config_keys(annotation, f"{prefix}{name}.")
            continue
        default = field.default_factory() if field.default_factory else field.default
        kind = next((repr(m) for m in field.metadata if type(m).__name__ == "PluginKind"), None)
        out.append(Key(f"{prefix}{name}", kind or type_name(annotation), default, field.description or ""))
        for sub in (a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)):
            out += config_keys(sub, f"{prefix}{name}[].")
    return out


HEADER = """# Configuration reference

*Generated from the schema by `scripts/render_config_reference.py`; do not edit by hand
(`tests/test_docs.py` fails when it is stale).*

A run's config is YAML plus dotted overrides (`loongsage train RECIPE engine.max_running=32`). Each
section is the config of one component, kept beside it (`loongsage/<component>/config.py`); an
unknown key, a wrong type or an impossible combination is a one-line error naming the key before
anything starts. `plugin(kind)` keys take a built-in name, a name registered in a `custom/` folder,
or `module:attr` ([extending.md](extending.md)).
"""


def render_reference() -> str:
    sections: dict[str, list[Key]] = {}
    for k in config_keys():
        sections.setdefault(k.key.split(".")[0].split("[")[0] if "." in k.key else "(top level)", []).append(k)
    lines = [HEADER]
    for section, keys in sections.items():
        lines += [f"## `{section}`" if section != "(top level)" else "## Top level", "",
                  "| key | type | default | meaning |", "|---|---|---|---|"]
        for k in keys:
            default = "required" if repr(k.default) == "PydanticUndefined" else f"`{k.default!r}`"
            cell = (lambda t: t.replace("|", "\\|").replace("\n", " "))
            lines.append(f"| `{k.key}` | `{cell(k.type)}` | {cell(default)} | {cell(k.description)} |")
        lines.append("")
    return "\n".join(lines)
