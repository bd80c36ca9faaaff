"""Checks of values that come from outside the typed config schema (a model's config.json, a request built in
Python, a user's task options): integers and numbers as the schema means them (a bool is neither; a numpy or 0-d
tensor integer is an integer), and a dataclass's fields against their annotations."""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from typing import Any


def is_int(v: Any) -> bool:
    """An integer value (a Python or numpy int, a 0-d integer tensor), not a bool: what a count, a token id, a
    sample id or a seed must be."""
    if isinstance(v, bool) or type(v).__name__ == "bool_":
        return False
    try:
        operator.index(v)
    except TypeError:
        return False
    return True


def is_number(v: Any) -> bool:
    """A real number (an int or a float of Python or numpy), not a bool."""
    return is_int(v) or isinstance(v, numbers.Real) and not isinstance(v, bool) and type(v).__name__ != "bool_"


def is_finite(x: numbers.Real) -> bool:
    """A real number a float holds finitely (an int beyond the doubles, e.g. 10**400, is not)."""
    try:
        return math.isfinite(x)
    except OverflowError:  # math.isfinite converts to a float
        return False


# a dataclass field's annotation -> (the check of a value, what it must be): the schema's own types, checked
# where values come from outside OmegaConf (a model's config.json, a request built in Python)
TYPE_CHECKS = {
    "int": (is_int, "an integer"),
    "int | None": (lambda v: v is None or is_int(v), "an integer or null"),
    "float": (is_number, "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "list[int]": (lambda v: isinstance(v, list | tuple) and all(map(is_int, v)), "a list of integers"),
}


def type_problems(obj: Any, cls: type | None = None) -> list[str]:
    """'name=value must be ...' for each field of the dataclass `cls` (obj's own by default) whose value in obj
    is not of its annotated type."""
    out = []
    for f in dataclasses.fields(cls or obj):
        v = getattr(obj, f.name)
        check, what = TYPE_CHECKS[f.type]
        if not check(v):
            out.append(f"{f.name}={v!r} ({type(v).__name__}) must be {what}")
    return out
