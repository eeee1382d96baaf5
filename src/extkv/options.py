"""Options declared once, as dataclass fields: each carries its default, its help and the
values it allows; keyword arguments are checked and command-line flags generated from it.

    @dataclass
    class Settings:
        port: int = option(8000, "port to bind", Int(1, 65535))

    check_options(settings)             # in __post_init__: every field against its kind
    add_options(parser, Settings)       # --port, parsed and checked by the same kind
    Settings(**options_from(args, Settings))

A kind parses the command line's text, checks a value (the message names the option
and the values it allows) and describes those values for `--help`.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

INT64_MAX = 2**63 - 1
_TRUE, _FALSE = ("true", "on", "yes", "1"), ("false", "off", "no", "0")


class Kind:
    """The values one option allows."""

    optional: bool = False  # None allowed too
    metavar: str = "VALUE"  # how --help names the flag's value

    def describe(self) -> str:
        """The allowed values in words, for `--help` and for the error that `check` raises."""
        raise NotImplementedError

    def accepts(self, value: object) -> bool:
        """Whether `value` is allowed as it stands; `check` turns a no into the error."""
        raise NotImplementedError

    def parse(self, text: str) -> object:
        """A command-line string as a value (then checked like any value)."""
        return text

    def check(self, name: str, value: object) -> object:
        """`value` if allowed (normalised, e.g. an int for a float), else a ValueError that
        names `name` and what it allows."""
        if value is None and self.optional:
            return None
        if not self.accepts(value):
            raise ValueError(f"{name} must be {self._allowed()}; got {value!r}")
        return value

    def _allowed(self) -> str:
        return self.describe() + (" or None" if self.optional else "")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Int(Kind):
    """An int in [minimum, maximum] (int64 by default: every count reaches a tensor)."""

    minimum: int = -INT64_MAX - 1
    maximum: int = INT64_MAX
    optional: bool = False
    metavar = "N"

    def describe(self) -> str:
        """The range in words; the int64 bound reads as 2**63."""
        if self.maximum == INT64_MAX:
            return f"an int in [{self.minimum}, 2**63)"
        return f"an int in [{self.minimum}, {self.maximum}]"

    def accepts(self, value: object) -> bool:
        """An int, not a bool, inside the range."""
        return _is_int(value) and self.minimum <= value <= self.maximum

    def parse(self, text: str) -> object:
        """The text as an int; other text is left for `check` to refuse by name."""
        try:
            return int(text)
        except ValueError:
            return text  # refused by check, with the message that says what is allowed


@dataclass(frozen=True)
class Float(Kind):
    """A finite number in [minimum, maximum]; `above_minimum` excludes the minimum."""

    minimum: float = -math.inf
    maximum: float = math.inf
    above_minimum: bool = False
    optional: bool = False
    metavar = "X"

    def describe(self) -> str:
        """The range in words, its open or closed minimum shown."""
        low = "(" if self.above_minimum else "["
        if self.maximum == math.inf:
            return f"a number {'>' if self.above_minimum else '>='} {self.minimum:g}"
        return f"a number in {low}{self.minimum:g}, {self.maximum:g}]"

    def accepts(self, value: object) -> bool:
        """A finite int or float (no bool, no NaN or inf) inside the range."""
        if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
            return False
        above = value > self.minimum if self.above_minimum else value >= self.minimum
        return above and value <= self.maximum

    def check(self, name: str, value: object) -> object:
        """As `Kind.check`, but an int comes back as a float, so the field's type holds."""
        value = super().check(name, value)
        return None if value is None else float(value)

    def parse(self, text: str) -> object:
        """The text as a float; other text is left for `check` to refuse by name."""
        try:
            return float(text)
        except ValueError:
            return text


@dataclass(frozen=True)
class Bool(Kind):
    """True or False (on the command line also on/off, yes/no, 1/0); never 0 or 1 as ints."""

    optional: bool = False
    metavar = "BOOL"

    def describe(self) -> str:
        """The allowed values in words, None included when optional."""
        return "True, False or None" if self.optional else "True or False"

    def _allowed(self) -> str:
        return self.describe()

    def accepts(self, value: object) -> bool:
        """Only a real bool: the ints 1 and 0 are refused."""
        return isinstance(value, bool)

    def parse(self, text: str) -> object:
        """true/on/yes/1 or false/off/no/0 in any case; other text is left for `check` to refuse."""
        lowered = text.lower()
        return True if lowered in _TRUE else False if lowered in _FALSE else text


@dataclass(frozen=True)
class Choice(Kind):
    """One of `choices` (compared by equality, bools by identity: True is not 1)."""

    choices: tuple[object, ...]
    optional: bool = False
    metavar = "CHOICE"

    def describe(self) -> str:
        """The choices as their reprs, so that strings show quoted; an enum's members as
        written in code (`Kind.NAME`), not as their reprs (`<Kind.NAME: 1>`)."""
        return "one of " + ", ".join(
            str(c) if isinstance(c, enum.Enum) else repr(c) for c in self.choices
        )

    def accepts(self, value: object) -> bool:
        """Whether `value` is one of the choices (a bool choice only matches that bool)."""
        return any(value is c if isinstance(c, bool) else value == c for c in self.choices)

    def parse(self, text: str) -> object:
        """The choice whose text matches, ignoring case; bool choices take the usual words too."""
        lowered = text.lower()
        for choice in self.choices:
            if isinstance(choice, bool):
                if lowered in (_TRUE if choice else _FALSE):
                    return choice
            elif str(choice).lower() == lowered:
                return choice
        return text


@dataclass(frozen=True)
class Text(Kind):
    """Any non-empty string (a path, a model name); the empty string is refused."""

    optional: bool = False
    metavar = "TEXT"

    def describe(self) -> str:
        """The allowed values in words, for `--help` and errors."""
        return "a non-empty string"

    def accepts(self, value: object) -> bool:
        """A str that is not empty."""
        return isinstance(value, str) and value != ""


@dataclass(frozen=True)
class File(Kind):
    """The path of a file this process can read (checked when the option is set, so that a
    wrong path fails at start-up rather than at first use)."""

    optional: bool = False
    metavar = "FILE"

    def describe(self) -> str:
        """The allowed values in words, for `--help` and errors."""
        return "the path of a readable file"

    def accepts(self, value: object) -> bool:
        """A str naming a regular file that can be opened for reading."""
        return isinstance(value, str) and os.path.isfile(value) and os.access(value, os.R_OK)

    def check(self, name: str, value: object) -> object:
        """As `Kind.check`, the message saying whether the file is missing or unreadable."""
        if value is None or self.accepts(value) or not isinstance(value, str):
            return super().check(name, value)
        why = "is not readable" if os.path.isfile(value) else "does not exist or is not a file"
        raise ValueError(f"{name} must be {self._allowed()}; {value!r} {why}")


@dataclass(frozen=True)
class Texts(Kind):
    """A list of non-empty strings (on the command line: the flag repeated)."""

    metavar = "TEXT"

    def describe(self) -> str:
        """The allowed values in words, for `--help` and errors."""
        return "a list of non-empty strings"

    def accepts(self, value: object) -> bool:
        """A list or tuple whose every item is a non-empty str."""
        return isinstance(value, list | tuple) and all(
            isinstance(v, str) and v != "" for v in value
        )

    def check(self, name: str, value: object) -> object:
        """As `Kind.check`, but always a tuple: an option's value is immutable."""
        return tuple(super().check(name, value))


@dataclass(frozen=True)
class Custom(Kind):
    """Values that a function resolves (e.g. a device or a dtype); it raises ValueError."""

    resolve: Callable[[object], object]
    description: str
    metavar: str = "VALUE"

    def describe(self) -> str:
        """The description given, since only the resolver knows what it takes."""
        return self.description

    def check(self, name: str, value: object) -> object:
        """The resolver's result; it, not `accepts`, decides and names what is wrong."""
        return self.resolve(value)


_NO_CLI = object()


def option(
    default: object,
    help: str,
    kind: Kind,
    *,
    flag: str | None = None,
    cli: bool = True,
    const: object = _NO_CLI,
) -> Any:
    """A dataclass field declaring one option. `flag`: the command-line name when not
    `--field-name`; `cli=False`: no flag; `const`: the value of the bare flag
    (default True for booleans, so `--enforce-eager` alone means true)."""
    metadata = {"help": help, "kind": kind, "flag": flag, "cli": cli, "const": const}
    if isinstance(default, list | dict | set):
        raise TypeError("option defaults must be immutable (a tuple, not a list)")
    return dataclasses.field(default=default, metadata=metadata)


def required(help: str, kind: Kind, *, flag: str | None = None) -> Any:
    """An option without a default (a required --flag on the command line)."""
    metadata = {"help": help, "kind": kind, "flag": flag, "cli": True, "const": _NO_CLI}
    return dataclasses.field(metadata=metadata)


def declared(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` declared with `option` or `required`."""
    return [f for f in dataclasses.fields(cls) if "kind" in f.metadata]


def check_options(obj: object) -> None:
    """Check (and normalise) every declared field of `obj`; works on frozen dataclasses."""
    for f in declared(type(obj)):
        value = f.metadata["kind"].check(f.name, getattr(obj, f.name))
        object.__setattr__(obj, f.name, value)


def check_names(cls: type, names: Iterable[str], what: str) -> None:
    """A TypeError naming the options `cls` accepts, for an unknown keyword."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(names) - known)
    if unknown:
        raise TypeError(
            f"{what} got unknown option(s) {', '.join(unknown)}; the options are: "
            + ", ".join(sorted(known))
        )


def flag_of(f: dataclasses.Field) -> str:
    """The field's command-line flag: its declared `flag`, else `--field-name`."""
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def _argument_type(name: str, kind: Kind) -> Callable[[str], object]:
    def parse(text: str) -> object:
        try:
            return kind.check(name, kind.parse(text))
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def add_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    skip: Iterable[str] = (),
    defaults: Mapping[str, object] | None = None,
) -> None:
    """A flag for every declared option of `cls` but `skip`, its default shown in the help;
    `defaults` replaces some defaults on this command line only."""
    defaults = defaults or {}
    unknown = set(defaults) - {f.name for f in declared(cls)}
    if unknown:  # a misspelt default would silently keep the declared one
        raise ValueError(f"defaults for options {cls.__name__} does not have: {sorted(unknown)}")
    for f in declared(cls):
        meta = f.metadata
        if f.name in skip or not meta["cli"]:
            continue
        kind: Kind = meta["kind"]
        kwargs: dict[str, Any] = {
            "dest": f.name,
            "type": _argument_type(flag_of(f), kind),
            "metavar": kind.metavar,
        }
        if f.default is dataclasses.MISSING and f.name not in defaults:
            kwargs["required"] = True
            kwargs["help"] = f"{meta['help']} ({kind.describe()}; required)"
        else:
            default = defaults.get(f.name, f.default)
            kwargs["default"] = default
            kwargs["help"] = f"{meta['help']} ({kind.describe()}; default: {default})"
        const = meta["const"]
        if const is _NO_CLI and isinstance(kind, Bool | Choice) and _takes_true(kind):
            const = True
        if isinstance(kind, Texts):
            kwargs.update(action="append", type=_argument_type(flag_of(f), Text()), default=None)
        elif const is not _NO_CLI:
            kwargs.update(nargs="?", const=const)
        parser.add_argument(flag_of(f), **kwargs)


def _takes_true(kind: Kind) -> bool:
    return isinstance(kind, Bool) or any(c is True for c in getattr(kind, "choices", ()))


def options_from(args: argparse.Namespace, cls: type) -> dict[str, object]:
    """The parsed values of `cls`'s options (those the command line has)."""
    values = {}
    for f in declared(cls):
        if hasattr(args, f.name):
            value = getattr(args, f.name)
            if isinstance(f.metadata["kind"], Texts) and value is None:
                value = f.default
            values[f.name] = value
    return values
