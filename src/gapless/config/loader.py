"""`load_config`: defaults < TOML file < dotted command-line overrides, validated.

Any bad input -- unknown key, wrong type, out-of-range value, malformed TOML -- raises
`ConfigError` with a one-line message naming the key and what is allowed; the CLI turns it into
exit code 2.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from gapless.config.checks import check_cross_field
from gapless.config.errors import ConfigError
from gapless.config.sections import Config


def load_config(path: str | Path | None = None, overrides: dict[str, str] | None = None) -> Config:
    """Defaults < TOML file at `path` < dotted `overrides` ({"trainer.lr": "3e-4"})."""
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_toml(Path(path))
    for dotted, raw in (overrides or {}).items():
        _set_dotted(data, dotted, _parse_scalar(raw))
    try:
        cfg = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
    check_cross_field(cfg)
    return cfg


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: malformed TOML: {exc}") from None


def _parse_scalar(raw: str) -> Any:
    """Parse a command-line value as a TOML value when it is one, else keep the string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for i, key in enumerate(parents):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parents[: i + 1])} is a value, not a section")
        node = child
    node[leaf] = value


def _describe(exc: ValidationError) -> str:
    err = exc.errors()[0]
    key = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        section = _section_at(err["loc"][:-1])
        allowed = ", ".join(section.model_fields) if section else "?"
        return f"unknown key '{key}'; allowed here: {allowed}"
    return f"{key}: {err['msg']} (got {err.get('input')!r})"


def _section_at(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type):
            return None
        if not issubclass(field.annotation, BaseModel):
            return None
        model = field.annotation
    return model
