"""Reading a recipe: YAML with ``base:`` chains, strict keys, ``section.key=value`` overrides, typed
construction of :class:`~megatron_gigpo.config.schema.Config` and the atomic write of a resolved recipe."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import shlex
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from megatron_gigpo.config.schema import Config
from megatron_gigpo.config.validation import resolve_auto_sizes, validate_config
from megatron_gigpo.files import write_text_atomic
from megatron_gigpo.fields import ConfigError, is_auto

# --------------------------------------------------------------------------------------------------
# Loading: YAML with `base:`, strict keys, overrides
# --------------------------------------------------------------------------------------------------


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _check_keys(data: dict, cls: type, source: str, prefix: str = "") -> None:
    """Raise ConfigError for any key in ``data`` that is not a field of ``cls`` (recursively)."""
    types_ = _field_types(cls)
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in types_:
            valid = list(types_)
            close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.5)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(valid)}"
            raise ConfigError(f"{source}: unknown key '{dotted}'{hint}")
        if dataclasses.is_dataclass(types_[key]):
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: '{dotted}' must be a mapping, got {value!r}")
            _check_keys(value, types_[key], source, dotted + ".")


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and key in out and isinstance(out[key], dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key written twice in one mapping (PyYAML keeps the last one
    silently, so a duplicated recipe key would hide the first value)."""

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_recipe(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: circular 'base:' chain {' -> '.join(map(str, seen + (path,)))}")
    where = f" (base of {seen[-1]})" if seen else ""
    if path.is_dir():
        raise ConfigError(f"recipe {path}{where} is a directory; name a recipe YAML file in it "
                          f"({', '.join(sorted(p.name for p in path.glob('*.yaml'))[:5]) or 'it has none'})")
    if not path.is_file():
        raise ConfigError(f"recipe file not found: {path}{where}")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"recipe {path}{where}: cannot read it: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"recipe {path}{where} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                          f"{exc.start}); a recipe is a YAML file in UTF-8") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping, got {type(data).__name__}")
    base_ref = data.pop("base", None)
    _check_keys(data, Config, str(path))
    if base_ref is None:
        return data
    base = _read_recipe(path.parent / str(base_ref), seen + (path,))
    return _deep_merge(base, data)


def parse_overrides(overrides: list[str]) -> dict:
    """Turn ``["env.max_steps=3", "rollout.stop=['</action>']"]`` into a nested dict. Each value is read as YAML,
    as in a recipe file, so a value that YAML cannot read (``[a,``, ``@x``, ``*x``, ``%x``) is refused rather than
    guessed at: quoting it (``'model.path="@x"'``) makes it a string.

    Raises:
        ConfigError: an override without ``=`` or without a section, or whose value is not valid YAML.
    """
    out: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"command line: override '{item}' must look like section.key=value")
        dotted, raw = item.split("=", 1)
        parts = dotted.strip().split(".")
        if len(parts) < 2 or not all(parts):
            raise ConfigError(f"command line: override '{item}' must name section.key")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = _override_value(item, dotted, raw)
    return out


def _override_value(item: str, dotted: str, raw: str) -> Any:
    if not raw.strip():
        return ""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        quoted = shlex.quote(f"{dotted}={json.dumps(raw)}")
        raise ConfigError(f"command line: override '{item}': the value is not valid YAML ({problem}); to mean the "
                          f"text itself, quote it: {quoted}") from None


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: invalid value {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, bool):  # YAML 1.1 reads on / off / yes / no as booleans
            raise ConfigError(f"{where}: expected str, got {value!r} (YAML reads on, off, yes and no as true or "
                              f"false: quote the word)")
    raise ConfigError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {value!r}")


def _build(cls: type, data: dict, where: str) -> Any:
    kwargs = {}
    types_ = _field_types(cls)
    for f in dataclasses.fields(cls):
        key = f"{where}.{f.name}" if where else f.name
        if f.name in data:
            value = data[f.name]
            if is_auto(f) and isinstance(value, str):  # `auto`: derived at load (resolve_auto_sizes), None till then
                if value.strip() != "auto":
                    raise ConfigError(f"{key}: expected a whole number or auto, got {value!r}")
                value = None
            kwargs[f.name] = _coerce(value, types_[f.name], key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            if dataclasses.is_dataclass(types_[f.name]):
                _build(types_[f.name], {}, key)  # names the first missing key inside the section

            raise ConfigError(f"missing required key '{key}'")
    return cls(**kwargs)


def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> Config:
    """Load a recipe YAML (following ``base:``), apply ``section.key=value`` overrides, derive the ``auto``
    sizes (:func:`~megatron_gigpo.config.validation.resolve_auto_sizes`), validate.

    Raises:
        ConfigError: unknown/misspelled key (names the file, the key and the closest valid key), wrong
            value type, missing required key, or a failed cross-field check.
    """
    data = _read_recipe(Path(path))
    cli = parse_overrides(list(overrides))
    _check_keys(cli, Config, "command line")
    data = _deep_merge(data, cli)
    try:
        cfg = _build(Config, data, "")
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    resolve_auto_sizes(cfg, source=str(path))
    validate_config(cfg, source=str(path))
    return cfg


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML atomically (temp file in the same folder, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


