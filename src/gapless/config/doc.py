"""Render the config reference (docs/configuration.md) from the field docstrings.

`python -m gapless.config.doc > docs/configuration.md`; a test keeps the file in sync.
"""

from __future__ import annotations

from pydantic import BaseModel

from gapless.config import Config


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from `src/gapless/config/sections.py` by `python -m gapless.config.doc`; do not edit by hand.",
        "Set a field in a TOML run file (`[section]` then `key = value`) or on the command line",
        "(`--section.key value`). Precedence: defaults < file < command line.",
        "",
    ]
    top = [(name, f) for name, f in Config.model_fields.items() if not _is_section(f.annotation)]
    lines += _table("top level", top)
    for name, field in Config.model_fields.items():
        if _is_section(field.annotation):
            lines += _table(f"[{name}]", list(field.annotation.model_fields.items()))
    return "\n".join(lines) + "\n"


def _is_section(annotation) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _table(title: str, fields) -> list[str]:
    out = [f"## {title}", "", "| key | default | meaning |", "| --- | --- | --- |"]
    for name, field in fields:
        doc = " ".join((field.description or "").split())
        out.append(f"| `{name}` | `{field.default!r}` | {doc} |")
    return out + [""]


if __name__ == "__main__":
    print(render(), end="")
