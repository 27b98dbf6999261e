"""The validated-configuration cache the gate's fast path reads instead of running pydantic."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gpuguard.adapters import configfile
from gpuguard.config import load_settings


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The default runtime_dir moved to a private directory (/run/gpuguard needs root).

    Files that set runtime_dir themselves need no such help; the tests below that do so prove it.
    """
    monkeypatch.setattr(configfile, "DEFAULT_RUNTIME_DIR", tmp_path / "run")
    return tmp_path / "run" / "config-cache"


def test_full_load_fills_the_cache(tmp_path: Path) -> None:
    """After a full load the same file's validated settings come back without pydantic."""
    path = tmp_path / "g.toml"
    path.write_text('idle_threshold_mib = 7\n[units."a.service"]\ngpus = [1, 2]\n')
    assert configfile.load_validated(path) is None
    load_settings(path)
    cached = configfile.load_validated(path)
    assert cached is not None
    assert cached["idle_threshold_mib"] == 7
    assert cached["units"]["a.service"]["gpus"] == [1, 2]
    assert cached["runtime_dir"] == "/run/gpuguard"


def test_the_cache_follows_the_files_runtime_dir(tmp_path: Path, cache_dir: Path) -> None:
    """A file that moves runtime_dir has its cache there, and nothing in the default place."""
    path = tmp_path / "g.toml"
    runtime_dir = tmp_path / "elsewhere"
    path.write_text(f'runtime_dir = "{runtime_dir}"\nidle_threshold_mib = 7\n')
    load_settings(path)
    (entry,) = (runtime_dir / "config-cache").iterdir()
    assert json.loads(entry.read_text())["settings"]["runtime_dir"] == str(runtime_dir)
    assert not cache_dir.exists()
    cached = configfile.load_validated(path)
    assert cached is not None
    assert cached["runtime_dir"] == str(runtime_dir)


@pytest.mark.parametrize(
    "text",
    ['runtime_dir = "relative/run"\n', "runtime_dir = 5\n", "runtime_dir = \n", b"runtime_dir\xff"],
)
def test_a_runtime_dir_the_text_does_not_give_means_no_cache(
    tmp_path: Path, text: str | bytes
) -> None:
    """A runtime_dir that is not an absolute path string (or text that is not TOML): no cache."""
    path = tmp_path / "g.toml"
    raw = text if isinstance(text, bytes) else text.encode()
    path.write_bytes(raw)
    assert configfile.cache_file(path, raw) is None
    configfile.store_validated(path, raw, {"runtime_dir": "/x"})
    assert configfile.load_validated(path) is None
    assert not (tmp_path / "run").exists()


def test_a_changed_file_misses_the_cache(tmp_path: Path) -> None:
    """Any change to the file's bytes forces a full load."""
    path = tmp_path / "g.toml"
    path.write_text("idle_threshold_mib = 7\n")
    load_settings(path)
    path.write_text("idle_threshold_mib = 8\n")
    assert configfile.load_validated(path) is None


def test_an_invalid_file_is_never_cached(tmp_path: Path) -> None:
    """A file that fails validation leaves nothing the fast path could use."""
    path = tmp_path / "g.toml"
    path.write_text("bogus = 1\n")
    with pytest.raises(Exception, match="unknown key"):
        load_settings(path)
    assert configfile.load_validated(path) is None


def test_a_cache_others_can_write_is_ignored(tmp_path: Path, cache_dir: Path) -> None:
    """A cache file writable by other users is not trusted (it decides which GPUs are looked at)."""
    path = tmp_path / "g.toml"
    path.write_text("idle_threshold_mib = 7\n")
    load_settings(path)
    (entry,) = cache_dir.iterdir()
    entry.chmod(0o666)
    assert configfile.load_validated(path) is None


def test_absent_default_file_caches_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no file at the default path, the defaults are cached and found again."""
    monkeypatch.delenv("GPUGUARD_CONFIG", raising=False)
    monkeypatch.setattr(configfile, "DEFAULT_CONFIG_PATH", tmp_path / "absent.toml")
    load_settings()
    cached = configfile.load_validated(None)
    assert cached is not None
    assert list(cached["units"]) == ["sglang.service"]


@pytest.mark.parametrize(
    "damage",
    ["other version", "other format", "no stamp", "key missing", "wrong type", "not JSON", "deep"],
)
def test_an_unexpected_cache_is_a_miss(tmp_path: Path, cache_dir: Path, damage: str) -> None:
    """Another gpuguard's cache, a missing key, a wrong type or garbage: a miss, never a crash."""
    path = tmp_path / "g.toml"
    path.write_text("idle_threshold_mib = 7\n")
    load_settings(path)
    (entry,) = cache_dir.iterdir()
    document = json.loads(entry.read_text())
    if damage == "other version":
        document["version"] = "0.0.1"
    elif damage == "other format":
        document["format"] = configfile.CACHE_FORMAT - 1
    elif damage == "no stamp":
        del document["format"], document["version"]
    elif damage == "key missing":
        del document["settings"]["nvml_timeout_s"]
    elif damage == "wrong type":
        document["settings"]["idle_threshold_mib"] = "7"
    text = {"not JSON": "{", "deep": "[" * 100_000}.get(damage) or json.dumps(document)
    entry.write_text(text)  # "deep": json.loads raises RecursionError, not ValueError
    assert configfile.load_validated(path) is None


@pytest.mark.parametrize(
    "text",
    [
        'runtime_dir = "/srv/run"\n',
        'idle_threshold_mib = 7\nruntime_dir="/srv/run" # moved\n[units."a.service"]\n',
        "runtime_dir = '/srv/literal'\n",
        'runtime_dir = "/srv/with space"\n',
        'runtime_dir = "/srv/esc\\u0041ped"\n',
        '[daemon]\ndry_run = true\n[units."a.service"]\ngpus = [1]\nruntime_dir = "/not/top"\n',
        'state_dir = """\nruntime_dir = "/in/a/string"\n"""\nruntime_dir = "/srv/real"\n',
    ],
)
def test_the_cache_directory_is_the_runtime_dir_toml_reads(tmp_path: Path, text: str) -> None:
    """The cheap line match and tomllib agree: the cache sits in the runtime_dir TOML gives."""
    if sys.version_info >= (3, 11):  # the reference reading
        import tomllib  # noqa: PLC0415
    else:
        import tomli as tomllib  # noqa: PLC0415

    raw = text.encode()
    cache = configfile.cache_file(tmp_path / "g.toml", raw)
    expected = tomllib.loads(text).get("runtime_dir")
    if expected is None:
        assert cache is not None
        assert cache.parent.parent == configfile.DEFAULT_RUNTIME_DIR
    else:
        assert cache is not None
        assert cache.parent.parent == Path(expected)
