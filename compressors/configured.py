"""``Configured``: a value that is its registry name and its constructor arguments.

A compressor travels as its spec string (``"qsgd:bits=4,chunk=256"``, read back by
:func:`compressors.from_spec`): the cross-rank config check compares specs, state dicts and
benchmark results record them, and two compressors with the same name and arguments are
interchangeable (equal, one hash). ``config()`` is the single source of all of it, so
``from_spec(c.spec()) == c`` holds for every configuration.

The test matrices enumerate a few configurations of every registered class; a class declares
them as constructor arguments (``example_configs``, ``edge_configs``) beside its other class
attributes, and :func:`compressors.registry.examples` builds them.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = ["Configured", "format_value"]


class Configured:
    """A registry name plus constructor arguments (see the module docstring).

    Attributes:
        name: registry name (``compressors.get(name)``).
        example_configs: constructor keyword arguments of a few small representative
            configurations (e.g. QSGD's ``bits`` 8, 4, 2): every test matrix runs each, the
            distributed ones with every algorithm the compressor supports, so keep it short.
            Default: the default configuration.
        edge_configs: extra configurations for the single-process round-trip tests only:
            settings at the edges of the codec (lossless densities, odd chunk sizes).
    """

    name: ClassVar[str] = "base"
    example_configs: ClassVar[tuple[dict, ...]] = ({},)
    edge_configs: ClassVar[tuple[dict, ...]] = ()

    def config(self) -> dict:
        """Constructor arguments, for specs, state dicts and the cross-rank config check."""
        return {}

    # tests/unit/test_compressor_roundtrip.py and tests/dist/algo_ranks.py build their cases
    # from these over compressors.REGISTRY, so a new compressor is tested by registering it
    @classmethod
    def examples(cls) -> list:
        """``example_configs`` built: the configurations every test matrix runs."""
        return [cls(**cfg) for cfg in cls.example_configs]

    @classmethod
    def edge_examples(cls) -> list:
        """``edge_configs`` built: the round-trip tests' extra configurations."""
        return [cls(**cfg) for cfg in cls.edge_configs]

    def spec(self) -> str:
        """``"name"`` or ``"name:key=value,..."`` (the form :func:`compressors.from_spec` reads)."""
        cfg = self.config()
        if not cfg:
            return self.name
        return self.name + ":" + ",".join(f"{k}={format_value(v)}" for k, v in cfg.items())

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.config() == other.config()

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(self.config().items()))))


def format_value(v) -> str:
    """One spec value as :func:`compressors.registry.parse_spec` reads it back."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v) if isinstance(v, float) else str(v)
