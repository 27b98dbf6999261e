"""The conventions every section of the configuration file is validated by.

A TOML author writes arrays and strings; the models hold tuples and paths, and take no "16" for
16, no key they do not know, no infinity and no NaN: a value a root process acts on is what the
file said, or the file is refused.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

DAY_S = 86400.0
"""The longest window or delay a section may set: longer ones are a typo, not a policy."""


class ConfigModel(BaseModel):
    """Strict types (no "16" for 16) but TOML arrays become tuples and strings become paths."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _from_toml(cls, value: object, info: ValidationInfo) -> object:
        annotation = cls.model_fields[info.field_name].annotation if info.field_name else None
        if isinstance(value, list):
            return tuple(value)
        if isinstance(value, str) and annotation in (Path, Path | None):
            return Path(value)
        return value
