"""Eager checks of numeric settings: type, finiteness and range, with actionable messages.

Every numeric knob of lppo is checked through :func:`check_number` when the object that owns
it is built, so a bad value stops the run at setup (before any model is built or any row is
generated) whichever way it arrived: the command line, a YAML file in any spelling YAML
allows (``.nan``, ``1e-3``, ``"1e400"``), or Python. The message names the key, the value,
what is allowed and how to fix it.
"""

from __future__ import annotations

import math
import numbers

from lppo.errors import SetupError


class SettingError(SetupError):
    """A setting has the wrong type, is not finite, or lies outside its allowed range."""


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high:g}"
    return "finite"


def check_number(
    key: str,
    value: object,
    *,
    integer: bool = False,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    optional: bool = False,
    fix: str = "",
) -> None:
    """Raise :class:`SettingError` unless ``value`` is a finite number in the given range.

    Args:
        key: the setting's full name as a user writes it (``model.actor.init_args.lr``).
        value: the value received.
        integer: the value must be an integer (``True``/``False`` are not numbers here).
        low: lower bound (``None``: unbounded below).
        high: upper bound (``None``: unbounded above).
        low_open: the lower bound itself is not allowed.
        high_open: the upper bound itself is not allowed.
        optional: ``None`` is allowed (it disables the feature the knob controls).
        fix: a hint appended to the message (what the value usually is, what to do).

    Raises:
        SettingError: naming ``key``, ``value``, the allowed range and ``fix``.
    """
    if value is None and optional:
        return
    kind = "an integer" if integer else "a finite number"
    if optional:
        kind += " or null"
    allowed = _interval(low, high, low_open, high_open)
    requirement = kind if allowed == "finite" else f"{kind} {allowed}"
    hint = f" {fix}" if fix else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SettingError(f"{key}={value!r} ({type(value).__name__}) must be {requirement}.{hint}")
    if integer and not isinstance(value, numbers.Integral):
        raise SettingError(f"{key}={value!r} must be {requirement}, not a fraction.{hint}")
    number = float(value)
    if not math.isfinite(number):
        raise SettingError(f"{key}={value!r} is not finite; it must be {requirement}.{hint}")
    too_low = low is not None and (number <= low if low_open else number < low)
    too_high = high is not None and (number >= high if high_open else number > high)
    if too_low or too_high:
        raise SettingError(f"{key}={value!r} is out of range; it must be {requirement}.{hint}")


def callback_key(callback: object, name: str) -> str:
    """Config key of a callback setting: ``trainer.callbacks[Evaluation].init_args.seed``."""
    return f"trainer.callbacks[{type(callback).__name__}].init_args.{name}"


def check_order(low_key: str, low: float, high_key: str, high: float, *, strict: bool) -> None:
    """Raise :class:`SettingError` unless ``low < high`` (``strict``) or ``low <= high``."""
    if (low >= high) if strict else (low > high):
        relation = "<" if strict else "<="
        raise SettingError(
            f"{low_key}={low!r} and {high_key}={high!r}: need {low_key} {relation} {high_key}; "
            "swap or fix them."
        )
