"""The base of every run config: typed, validated keys, grouped in sections, set by flat names.

A config is a frozen dataclass. Its fields are either keys (``int``, ``float``, ``bool``,
``str``, or a ``Literal`` of the accepted strings) or *sections*: fields whose type is itself a
dataclass of keys (:class:`~handbook_lib.core.config.RunConfig` composes ``model``, ``data``,
``layout``, ``numerics`` and ``levers``). Every key has one flat name, unique across the
sections, so a notebook (``config={"num_layers": 2}``), the terminal (``--set num_layers=2``) and
the ranks' ``config.json`` keep one spelling; ``model.num_layers`` names the same key by its
section. ``config.num_layers`` reads it from its section, ``config.model`` is the section.

An unknown key or a value outside the accepted set raises ``ValueError`` naming the key and what
is accepted: nothing is silently ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar, get_args, get_origin, get_type_hints

from handbook_lib.core.checks import BadText, check_int, parse_bool, parse_float, parse_int

__all__ = ["FlatConfig", "check_value"]

_C = TypeVar("_C", bound="FlatConfig")


def check_value(key: str, kind: Any, value: object) -> None:
    """Refuse ``value`` for config key ``key`` of type ``kind`` (a ``Literal`` of strings, or
    ``int``, ``float``, ``bool``, ``str``); a ``float`` must be finite, a ``bool`` is no ``int``.

    Raises:
        ValueError: ``"config key 'steps' must be int, got 2.5"``, or for a ``Literal``
            ``"config key 'api' got 'x'; accepted values: fsdp2, fsdp1"``.
    """
    if get_origin(kind) is Literal:
        if value not in get_args(kind):
            raise ValueError(f"config key {key!r} got {value!r}; accepted values: {', '.join(get_args(kind))}")
        return
    ok = (
        isinstance(value, bool) if kind is bool
        else isinstance(value, int) and not isinstance(value, bool) if kind is int
        else isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float
        else isinstance(value, kind)
    )
    if not ok:
        raise ValueError(f"config key {key!r} must be {kind.__name__}, got {value!r}")
    if kind is float and not math.isfinite(value):  # type: ignore[arg-type]  # a number, checked above
        raise ValueError(f"config key {key!r} must be a finite number, got {value!r}")


def _is_section(kind: Any) -> bool:
    return isinstance(kind, type) and dataclasses.is_dataclass(kind)


@functools.cache
def _layout(cls: type) -> tuple[dict[str, type], dict[str, str], dict[str, Any]]:
    """``cls``'s sections by field name, the section each flat key lives in (absent: a key of
    ``cls`` itself), and every flat key's type."""
    hints = get_type_hints(cls)
    sections: dict[str, type] = {}
    homes: dict[str, str] = {}
    kinds: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        if _is_section(kind):
            sections[field.name] = kind
            inner = get_type_hints(kind)
            for key in (f.name for f in dataclasses.fields(kind)):
                homes[key], kinds[key] = field.name, inner[key]
        else:
            kinds[field.name] = kind
    clash = sorted(set(homes) & {f.name for f in dataclasses.fields(cls) if f.name not in sections})
    if clash:  # a key has one home: change its default through its section's
        raise TypeError(f"{cls.__name__} declares {', '.join(clash)} again, outside its section")
    return sections, homes, kinds


class _RoutesKeys(type):
    """Lets a config be built from flat keys (``RunConfig(steps=3)``): each key given by its
    flat or dotted name (``data.steps``) goes into its section, the section's other keys keep
    the config class's defaults."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if args:
            raise TypeError(f"{cls.__name__} takes its keys by name, e.g. {cls.__name__}(steps=3)")
        return super().__call__(**_route(cls, kwargs))  # type: ignore[arg-type]  # cls: a FlatConfig


def _flat_name(homes: Mapping[str, str], key: str) -> str:
    """``key``'s flat name: ``"data.steps"`` is ``"steps"`` where ``steps`` lives in ``data``;
    any other key is its own."""
    section, dot, inner = key.partition(".")
    return inner if dot and homes.get(inner) == section else key


def _route(cls: type[FlatConfig], given: Mapping[str, Any]) -> dict[str, Any]:
    sections, homes, kinds = _layout(cls)
    out: dict[str, Any] = {}
    per: dict[str, dict[str, Any]] = {}
    for dotted, value in given.items():
        key = _flat_name(homes, dotted)
        if key in sections:
            out[key] = value
        elif key in homes:
            per.setdefault(homes[key], {})[key] = value
        else:
            out[key] = value  # a key of the class itself, or an unknown one (a TypeError below)
    defaults = {f.name: f for f in dataclasses.fields(cls)}
    for name, values in per.items():
        base = out.get(name)
        if base is None:
            factory = defaults[name].default_factory
            base = factory() if factory is not dataclasses.MISSING else sections[name]()
        kind = sections[name]
        if not issubclass(kind, FlatConfig):  # a plain dataclass (ModelConfig): its keys checked here
            for key, value in values.items():
                check_value(key, kinds[key], value)
        out[name] = kind(**{**{f.name: getattr(base, f.name) for f in dataclasses.fields(kind)}, **values})
    return out


@dataclass(frozen=True)
class FlatConfig(metaclass=_RoutesKeys):
    """Base of every run config: a frozen dataclass of flat, typed, validated keys, some of them
    grouped in sections (see the module's docstring).

    A ``float`` key must be finite: ``nan`` and ``inf`` are refused (an infinite learning rate
    would only train to NaN). An ``int`` key named in :attr:`MINIMUMS` must be at least its
    minimum.
    """

    MINIMUMS: ClassVar[Mapping[str, int]] = {}
    """The smallest value of each ``int`` key that has one (a subclass extends its base's, a
    config its sections')."""
    FLOAT_BOUNDS: ClassVar[Mapping[str, tuple[float, bool]]] = {}
    """The lower bound of each ``float`` key that has one, and whether the bound itself is
    refused (``(0.0, True)``: ``> 0``); what ``--set`` says the key accepts."""

    def __post_init__(self) -> None:
        sections, homes, kinds = _layout(type(self))
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in sections:
                if not isinstance(value, sections[field.name]):
                    raise ValueError(f"config section {field.name!r} must be a {sections[field.name].__name__}, "
                                     f"got {value!r}")
                continue
            check_value(field.name, kinds[field.name], value)
        for key, minimum in self.MINIMUMS.items():
            if key not in homes:  # a section checks its own
                check_int(f"config key {key!r}", getattr(self, key), minimum)

    def __getattr__(self, name: str) -> Any:
        """A key of a section by its flat name: ``config.steps`` is ``config.data.steps``."""
        home = None if name.startswith("__") else _layout(type(self))[1].get(name)
        if home is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, home), name)

    @classmethod
    def sections(cls) -> dict[str, tuple[str, ...]]:
        """Each section's name and its keys, in order (``{"model": ("vocab_size", ...), ...}``)."""
        sections, homes, _ = _layout(cls)
        return {name: tuple(k for k, home in homes.items() if home == name) for name in sections}

    @classmethod
    def choices(cls) -> dict[str, tuple[str, ...]]:
        """The accepted values of each ``Literal`` key, e.g. ``{"strategy": ("NONE", ...)}``."""
        kinds = _layout(cls)[2]
        return {key: get_args(kinds[key]) for key in cls.keys() if get_origin(kinds[key]) is Literal}

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The accepted flat keys: a base class's first, in its order, then the ones a class adds
        (wherever they live), in declaration order."""
        flat = list(_layout(cls)[2])
        base = next((b for b in cls.__mro__[1:] if issubclass(b, FlatConfig) and dataclasses.fields(b)), None)
        head = [key for key in (base.keys() if base else ()) if key in flat]
        return tuple(head + [key for key in flat if key not in head])

    @classmethod
    def from_mapping(cls: type[_C], mapping: Mapping[str, Any] | None = None) -> _C:
        """Build a config from a dict of flat (``steps``) or dotted (``data.steps``) keys; values
        may be typed or strings (as from ``--set``).

        Raises:
            ValueError: on an unknown key (listing the accepted keys) or a bad value.
        """
        mapping = dict(mapping or {})
        _, homes, kinds = _layout(cls)
        flat: dict[str, Any] = {}
        for key, value in mapping.items():
            name = _flat_name(homes, key)
            if name in flat:
                raise ValueError(f"config key {name!r} given twice, by its name and its section's ({key!r})")
            flat[name] = value
        unknown = sorted(set(flat) - set(cls.keys()))
        if unknown:
            hints = [f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key) for key in unknown
                     for close in [difflib.get_close_matches(key, cls.keys(), n=1)]]
            raise ValueError(  # the first line stays short; the whole list follows
                f"unknown config key(s) {', '.join(hints)} for {cls.__name__}\n"
                f"accepted keys: {', '.join(cls.keys())}"
            )
        values = {key: cls._parse_text(key, kinds[key], value)
                  if isinstance(value, str) and kinds[key] in (int, float, bool) else value
                  for key, value in flat.items()}
        return cls(**values)

    @classmethod
    def _parse_text(cls, key: str, kind: type, text: str) -> int | float | bool:
        """The value of ``key`` typed as ``text`` (a ``--set``), read by the one parser of its
        type with the key's accepted range.

        Raises:
            ValueError: ``"--set steps=3.0: steps takes a whole number >= 1"``.
        """
        try:
            if kind is bool:
                return parse_bool(text)
            if kind is float:
                bound, strict = cls.FLOAT_BOUNDS.get(key, (None, False))
                return parse_float(text, None if strict else bound, above=bound if strict else None)
            sections, homes, _ = _layout(cls)
            inner = getattr(sections[homes[key]], "MINIMUMS", {}) if key in homes else {}
            return parse_int(text, cls.MINIMUMS.get(key, inner.get(key)))
        except BadText as err:
            raise ValueError(f"--set {key}={text}: {key} takes {err.accepted}") from None

    def replace(self: _C, **changes: Any) -> _C:
        """A copy with some keys changed (validated like :meth:`from_mapping`)."""
        return self.from_mapping({**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain, JSON-ready dict of flat keys, in :meth:`keys` order."""
        return {key: getattr(self, key) for key in self.keys()}

    def to_sections(self) -> dict[str, Any]:
        """The config as a dict of sections (each a dict of its keys) and the class's own keys."""
        return dataclasses.asdict(self)
