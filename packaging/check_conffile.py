#!/usr/bin/env python3
"""Check that the shipped /etc/gpuguard/gpuguard.toml documents every key with its default.

    python3 packaging/check_conffile.py packaging/gpuguard.toml

The conffile lists each setting commented out (``#key = value``; prose comments start with
``# ``), but for the few it sets live (``[daemon]`` and its ``dry_run = false``, the line the
off switch in docs/install.md rewrites). Uncommented, the file must be valid, name every key of
the configuration models, and equal the defaults, except lines marked ``# example`` (keys whose
default is "unset"); so a live line, too, must hold the default. Run by the
package build, so a key added to gpuguard.config without a line here fails the build instead of
shipping a conffile that silently lacks it.
"""

from __future__ import annotations

import inspect
import re
import sys
import typing
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib
from typing import Any

from pydantic import BaseModel

from gpuguard.config import Settings

_SETTING = re.compile(r"^#(?=[A-Za-z_\[])")
_LIVE = re.compile(r"^[A-Za-z_\[]")
_KEY = re.compile(r"^\[?([A-Za-z_][A-Za-z0-9_]*)[\]\s.=]")
_EXAMPLE = re.compile(r"#\s*example\b")


def uncommented(text: str) -> tuple[str, str]:
    """The file with every setting line uncommented: with and without the ``# example`` lines."""
    full: list[str] = []
    defaults: list[str] = []
    for line in text.splitlines():
        if _SETTING.match(line):
            setting = line[1:]
        elif _LIVE.match(line):
            setting = line
        else:
            continue
        full.append(setting)
        if not _EXAMPLE.search(setting):
            defaults.append(setting)
    return "\n".join(full) + "\n", "\n".join(defaults) + "\n"


def model_keys(model: type[BaseModel]) -> set[str]:
    """Every key of ``model`` and of the models inside it (tables, and dicts of tables)."""
    keys = set(model.model_fields)
    for field in model.model_fields.values():
        for inner in (field.annotation, *typing.get_args(field.annotation)):
            if inspect.isclass(inner) and issubclass(inner, BaseModel):
                keys |= model_keys(inner)
    return keys


def problems(text: str) -> list[str]:
    """Everything wrong with the conffile's text; empty when it is right."""
    full, defaults = uncommented(text)
    found: list[str] = []
    try:
        Settings.model_validate(tomllib.loads(full))
        data: dict[str, Any] = tomllib.loads(defaults)
        settings = Settings.model_validate(data)
    except (tomllib.TOMLDecodeError, ValueError) as err:
        return [f"the uncommented settings are not a valid configuration: {err}"]
    expected = Settings().model_dump(mode="json")
    actual = settings.model_dump(mode="json")
    found.extend(
        f"{key} = {actual[key]!r} but the default is {expected[key]!r}"
        for key in expected
        if actual[key] != expected[key]
    )
    keys = {match[1] for line in full.splitlines() if (match := _KEY.match(line))}
    missing = model_keys(Settings) - keys
    found.extend(f"key {key} is not documented" for key in sorted(missing))
    return found


def main(argv: list[str]) -> int:
    """Check the file named on the command line; print each problem."""
    if len(argv) != 1:
        sys.stderr.write("usage: check_conffile.py GPUGUARD_TOML\n")
        return 64
    path = Path(argv[0])
    found = problems(path.read_text(encoding="utf-8"))
    for problem in found:
        sys.stderr.write(f"{path}: {problem}\n")
    if not found:
        sys.stdout.write(f"{path}: every key documented with its default\n")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
