"""Name -> compressor class registry and ``"name:key=value,..."`` spec strings."""

from __future__ import annotations

import inspect
import logging
from typing import Callable

from .base import Compressor

__all__ = ["REGISTRY", "register", "get", "from_spec", "parse_spec", "available", "registered_classes",
           "examples"]

logger = logging.getLogger(__name__)

REGISTRY: dict[str, type[Compressor]] = {}


def register(*names: str) -> Callable[[type[Compressor]], type[Compressor]]:
    """Class decorator: make a compressor reachable by ``get(name)`` and specs."""

    def deco(cls: type[Compressor]) -> type[Compressor]:
        for n in names or (cls.name,):
            if n in REGISTRY and REGISTRY[n] is not cls:
                raise ValueError(f"compressor name {n!r} already registered by {REGISTRY[n].__name__}")
            REGISTRY[n] = cls
        return cls

    return deco


def available() -> list[str]:
    return sorted(REGISTRY)


def registered_classes() -> list[type[Compressor]]:
    """Every registered compressor class once (aliases share a class), in registration order."""
    return list(dict.fromkeys(REGISTRY.values()))


def examples(edge: bool = False) -> list[Compressor]:
    """``cls.examples()`` of every registered class (plus ``cls.edge_examples()`` when
    ``edge``), in registration order: the cases of the test matrices."""
    out: list[Compressor] = []
    for cls in registered_classes():
        out += cls.examples() + (cls.edge_examples() if edge else [])
    return out


def get(name: str, **kwargs) -> Compressor:
    """Build a registered compressor: ``get("topk", density=0.01)``.

    Raises:
        ValueError: unknown name or unknown keyword (named in the message).
    """
    if not isinstance(name, str):
        raise TypeError(f"compressor name must be a str, got {name!r}")
    try:
        cls = REGISTRY[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown compressor {name!r}; known: {', '.join(available())}") from None
    params = inspect.signature(cls.__init__).parameters
    known = [p for p, v in params.items() if p != "self"
             and v.kind in (v.POSITIONAL_OR_KEYWORD, v.KEYWORD_ONLY)]
    for k in kwargs:
        if k not in known:
            raise ValueError(f"compressor {name!r} has no option {k!r}; options: {known}")
    return cls(**kwargs)


def _parse_value(text: str):
    t = text.strip()
    low = t.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    for conv in (int, float):
        try:
            return conv(t)
        except ValueError:
            pass
    return t


def parse_spec(spec: str) -> tuple[str, dict]:
    """``"topk:density=0.01,exact=false"`` -> ``("topk", {"density": 0.01, "exact": False})``."""
    if not isinstance(spec, str):
        raise TypeError(f"compressor spec must be a str, got {spec!r}")
    name, sep, rest = spec.strip().partition(":")
    if not name:
        raise ValueError(f"malformed compressor spec {spec!r}: missing name")
    kwargs: dict = {}
    if sep and not rest.strip():
        raise ValueError(f"malformed compressor spec {spec!r}: nothing after ':'")
    for item in filter(None, (p.strip() for p in rest.split(","))) if sep else ():
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ValueError(f"malformed compressor spec {spec!r}: expected key=value, got {item!r}")
        key = key.strip()
        if key in kwargs:
            raise ValueError(f"malformed compressor spec {spec!r}: {key!r} given twice")
        kwargs[key] = _parse_value(value)
    return name.strip().lower(), kwargs


def from_spec(spec: "str | Compressor") -> Compressor:
    """Build a compressor from a spec string (or pass a ``Compressor`` through)."""
    if isinstance(spec, Compressor):
        return spec
    name, kwargs = parse_spec(spec)
    return get(name, **kwargs)
