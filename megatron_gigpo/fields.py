"""Settings that carry their own check: the allowed range of a number or the valid values of a string, stated
next to the default in the dataclass field (``field(metadata=...)``), and one generic checker for a whole tree of
such dataclasses (used by :func:`megatron_gigpo.config.validate_config` on the recipe). Every component declares
its settings dataclass with these, next to the code that reads it (``algo/config.py``, ``rollout/config.py``, ...);
:mod:`megatron_gigpo.config` only assembles the sections into the recipe tree.

Example::

    @dataclass
    class RolloutConfig:
        top_p: float = num(1.0, gt=0, le=1)          # refused outside (0, 1]
        weight_sync_mode: str = choice("colocated", ("colocated", "disaggregated"))
        # the names of a registry, read when the recipe is checked (its module imports torch)
        policy_loss: str = choice("vanilla", "megatron_gigpo.algo.losses:POLICY_LOSSES")
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ConfigError", "MAX_SEED", "Range", "num", "is_auto", "choice", "field_choices", "leaf_fields",
           "field_errors"]


class ConfigError(ValueError):
    """A recipe is malformed or inconsistent. The message names the file and key."""


MAX_SEED = 2**31 - 1  # the largest seed any section accepts (numpy and torch take 32-bit seeds)


@dataclass(frozen=True)
class Range:
    """The allowed values of a numeric setting: an interval, each end open, closed or unbounded (None).

    ``str(Range(gt=0, le=1))`` is ``"in (0, 1]"``; a one-sided range reads ``">= 1"`` or ``"> 0"``. A list
    setting (``list[int]``) is checked item by item and, with ``length``, for its number of items. NaN and the
    infinities are in no range (a setting is a finite number: ``inf`` or ``1e400`` as a learning rate, a clip
    ratio or a temperature only ever poisons the run).
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    length: int | None = None

    def __contains__(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return not ((self.ge is not None and not value >= self.ge) or (self.gt is not None and not value > self.gt)
                    or (self.le is not None and not value <= self.le) or (self.lt is not None and not value < self.lt))

    def __str__(self) -> str:
        def text(x: float) -> str:
            return str(int(x)) if float(x).is_integer() else f"{x:g}"

        lo = (f"[{text(self.ge)}", f">= {text(self.ge)}") if self.ge is not None else (
            (f"({text(self.gt)}", f"> {text(self.gt)}") if self.gt is not None else None)
        hi = (f"{text(self.le)}]", f"<= {text(self.le)}") if self.le is not None else (
            (f"{text(self.lt)})", f"< {text(self.lt)}") if self.lt is not None else None)
        if lo and hi:
            return f"in {lo[0]}, {hi[0]}"
        return (lo or hi or ("any number", "any number"))[1]


def num(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, ge: float | None = None,
        gt: float | None = None, le: float | None = None, lt: float | None = None, length: int | None = None,
        auto: bool = False) -> Any:
    """A numeric dataclass field (or list of numbers, with ``factory``) with its allowed range.

    ``auto=True``: the field (typed ``int | None``) may also be ``auto`` (or ``null``) in a recipe, read as None
    and replaced by a derived number when the recipe is loaded (:func:`is_auto`;
    :func:`megatron_gigpo.config.load_config` derives it), so every reader of a loaded recipe sees a number.
    """
    return field(default=default, default_factory=factory,
                 metadata={"range": Range(ge=ge, gt=gt, le=le, lt=lt, length=length), "auto": auto})


def is_auto(f: dataclasses.Field) -> bool:
    """Whether ``f`` was declared with ``num(..., auto=True)``: ``auto`` / ``null`` in a recipe means derived."""
    return bool(f.metadata.get("auto"))


def choice(default: Any = dataclasses.MISSING, choices: tuple[str, ...] | str | Callable[[], Iterable[str]] = (), *,
           factory: Any = dataclasses.MISSING) -> Any:
    """A string dataclass field (or list of strings, with ``factory``) with its valid values: a tuple; or a
    registry named ``"package.module:NAME"`` (a dict, whose keys are the names, or a tuple), imported when the
    value is checked, so that a settings module never imports the code it configures; or a function returning
    them. A list is checked item by item."""
    return field(default=default, default_factory=factory, metadata={"choices": choices})


def field_choices(f: dataclasses.Field) -> tuple[str, ...] | None:
    """The valid values of a choice field, else None.

    Raises:
        ImportError / AttributeError: a registry reference ``"module:NAME"`` that does not resolve.
    """
    allowed = f.metadata.get("choices")
    if allowed is None:
        return None
    if isinstance(allowed, str):
        module, _, name = allowed.partition(":")
        allowed = getattr(importlib.import_module(module), name)
    return tuple(allowed() if callable(allowed) else allowed)


def leaf_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """Every leaf field of a tree of dataclasses: ``(dotted key, field, resolved type)``, depth first."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            yield from leaf_fields(tp, key + ".")
        else:
            yield key, f, tp


def _range_error(key: str, value: float, rng: Range) -> str:
    finite = " and finite" if isinstance(value, float) and not math.isfinite(value) else ""
    return f"{key}={value!r} must be {rng}{finite}"


def field_errors(obj: Any) -> list[str]:
    """One message per value of ``obj`` (a dataclass tree) outside its field's range or choices, naming the
    dotted key, the value and what is allowed (``"rollout.top_p=2.0 must be in (0, 1]"``,
    ``"optim.lr=inf must be > 0 and finite"``); None values and fields without metadata are not checked."""
    errors = []
    for key, f, _ in leaf_fields(type(obj)):
        value = obj
        for part in key.split("."):
            value = getattr(value, part)
        allowed, rng = field_choices(f), f.metadata.get("range")
        if allowed is not None and isinstance(value, list):
            errors += [f"{key}[{i}]={v!r} is not one of {', '.join(allowed)}" for i, v in enumerate(value)
                       if v not in allowed]
        elif allowed is not None and value is not None and value not in allowed:  # null: the field's type says
            errors.append(f"{key}={value!r} is not one of {', '.join(allowed)}")
        if rng is None or value is None:
            continue
        if isinstance(value, list):
            if rng.length is not None and len(value) != rng.length:
                errors.append(f"{key}={value!r} must have {rng.length} items")
            errors += [_range_error(f"{key}[{i}]", v, rng) for i, v in enumerate(value) if v not in rng]
        elif value not in rng:
            errors.append(_range_error(key, value, rng))
    return errors
