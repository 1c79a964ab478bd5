"""The named pieces a config chooses (`selector: walk`, `conv: two_tap`): the built-in ones and a
researcher's own, registered once and then named by any config, CLI flag or saved drafter.

    @register_selector("no_repeat")          # or register_selector("no_repeat", NoRepeat)
    class NoRepeat:                          # a dflash2.Selector; built as NoRepeat(config)
        ...
    drafter.with_selector("no_repeat")       # or DFlash2Config(selector="no_repeat")

A name of the form "package.module:Name" needs no registration: the module is imported and `Name`
registered under that name. A factory is called with the drafter's DFlash2Config and returns the
piece: a selector has the members of `dflash2.interfaces.Selector` (checked when built); a
convolution is an nn.Module `conv(h, sublayer, rows)` around one sublayer (`dflash2.drafter.conv`).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Registry:
    """Names → factories of one kind of piece."""

    def __init__(self, kind: str, builtins: tuple[str, ...], check: Callable[[Any, str], Any] | None = None) -> None:
        self.kind, self._builtins, self._check = kind, builtins, check
        self._factories: dict[str, Callable[[Any], Any]] = {}

    def register(self, name: str, factory: F | None = None, *, replace: bool = False):
        """Register `factory` under `name` (as a decorator when `factory` is None); returns the factory.
        A name already taken by another factory is refused unless `replace`."""
        if not isinstance(name, str) or not name or any(c.isspace() for c in name):
            raise ValueError(f"a {self.kind} name is a non-empty string without spaces, got {name!r}")

        def add(f: F) -> F:
            if not callable(f):
                raise TypeError(f"register_{self.kind}({name!r}, ...): a factory is a class or a function of the "
                                f"DFlash2Config, got {type(f).__name__}")
            taken = self._factories.get(name)
            if taken is not None and taken is not f and not replace:
                raise ValueError(f"the {self.kind} name {name!r} is taken by {_qualname(taken)}; pick another name "
                                 f"or pass replace=True")
            self._factories[name] = f
            return f

        return add if factory is None else add(factory)

    def name_of(self, factory: Callable[[Any], Any]) -> str | None:
        """The first name `factory` is registered under (None: not registered)."""
        self._load_builtins()
        return next((name for name, f in self._factories.items() if f is factory), None)

    def names(self) -> tuple[str, ...]:
        self._load_builtins()
        return tuple(self._factories)

    def known(self, name: str) -> bool:
        """Registered, or a "module:Name" that imports (and is then registered)."""
        try:
            self.factory(name)
        except ValueError:
            return False
        return True

    def factory(self, name: str) -> Callable[[Any], Any]:
        self._load_builtins()
        if name in self._factories:
            return self._factories[name]
        if isinstance(name, str) and ":" in name:
            module, _, attr = name.partition(":")
            try:
                found = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as error:
                raise ValueError(f"{self.kind} {name!r}: cannot import {attr} from {module} ({error})") from None
            return self.register(name, found)
        raise ValueError(f"unknown {self.kind} {name!r}: registered are {list(self._factories)}; register your own "
                         f"with dflash2.register_{self.kind}(name, factory) before the config is read, or name it "
                         f"as 'package.module:Name'")

    def build(self, name: str, config) -> Any:
        piece = self.factory(name)(config)
        return self._check(piece, name) if self._check is not None else piece

    def _load_builtins(self) -> None:
        for module in self._builtins:  # each registers its built-in pieces on first import
            importlib.import_module(module)


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _check_selector(selector: Any, name: str) -> Any:
    from dflash2.drafter.selectors.contract import complete_selector

    return complete_selector(selector, name)


SELECTORS = Registry("selector", ("dflash2.drafter.selectors.codebook", "dflash2.drafter.selectors.dspark",
                                  "dflash2.drafter.selectors.lilicorr"), _check_selector)
CONVS = Registry("conv", ("dflash2.drafter.conv",))


def register_selector(name: str, factory: F | None = None, *, replace: bool = False):
    """Make `name` a selector every config can choose: `factory(config)` builds it (a class works)."""
    return SELECTORS.register(name, factory, replace=replace)


def register_conv(name: str, factory: F | None = None, *, replace: bool = False):
    """Make `name` a convolution every config can choose: `factory(config)` builds one per sublayer."""
    return CONVS.register(name, factory, replace=replace)


__all__ = ["CONVS", "SELECTORS", "Registry", "register_conv", "register_selector"]
