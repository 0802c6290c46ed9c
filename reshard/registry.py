"""The one way a name is bound in a registry (kinds, layers, quant methods, model adjustments): by a
decorator that refuses a name bound twice and lists the names known (house rule: registries fail
loudly)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from reshard.errors import RegistryError

F = TypeVar("F")


def registrar(table: dict[str, F], names: tuple[str, ...], what: Callable[[str], str], *,
              known: str = "known") -> Callable[[F], F]:
    """A decorator binding each of `names` to the decorated object in `table`; a name already bound
    raises `RegistryError("<what(name)> is already registered; <known>: <names bound>")`."""

    def deco(fn: F) -> F:
        for name in names:
            if name in table:
                raise RegistryError(f"{what(name)} is already registered; {known}: {', '.join(sorted(table))}")
            table[name] = fn
        return fn

    return deco
