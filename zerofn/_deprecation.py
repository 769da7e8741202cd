"""Renamed keywords and attributes: the old names work for one release, with a warning.

zerofn uses one word per concept: ``precision`` for a :class:`~zerofn.PrecisionPolicy`,
``comm_policy`` for a :class:`~zerofn.CommPolicy`. Earlier releases said ``policy`` for
either; :func:`renamed` maps such an old keyword onto its new name.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["UNSET", "renamed"]


class _Unset:
    """The default of a deprecated keyword: tells "not given" from an explicit ``None``."""

    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()


def renamed(where: str, old: str, new: str, old_value: Any, new_value: Any, *, stacklevel: int = 3) -> Any:
    """The value for keyword ``new``, taking a value given under its old name ``old``.

    Warns (``DeprecationWarning``, naming the new keyword) when ``old`` was given; raises
    ``TypeError`` when both were.
    """
    if old_value is UNSET:
        return new_value
    if new_value is not None:
        raise TypeError(f"{where}: got both {old}= and {new}=; pass only {new}= ({old}= is its old name)")
    warnings.warn(
        f"{where}: the keyword {old}= is deprecated and will be removed in the next release; use {new}= instead",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    return old_value
