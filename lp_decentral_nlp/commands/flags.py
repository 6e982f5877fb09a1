"""The recipes' flags: every ``TrainingArguments`` flag in the transformers spelling, plus short aliases.

The command line is a :class:`transformers.HfArgumentParser` over
:class:`~lp_decentral_nlp.trainer.DecentralizedTrainingArguments` and a recipe's own small
dataclass (model, data, ...). Checking is done once, by the dataclasses: the parser builds them
and turns their ``ValueError``/``TypeError`` into the one-line flag error. The parser itself adds
only what a dataclass cannot see: a number that is not a number, NaN/inf, an integer written as
a float, and the ranges of the ``TrainingArguments`` fields transformers does not check
(:data:`TRAINING_RANGES`).

Adding an alias is one line in :data:`ALIASES`.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import re
from typing import NamedTuple

from transformers import HfArgumentParser
from transformers.hf_argparser import string_to_bool

# Short flag -> the transformers-spelt option it stands for (without the leading dashes). The
# ``no_<field>`` options are the negations HfArgumentParser makes for boolean fields defaulting to True. An
# alias that is also HfArgumentParser's dashed spelling (``--final-merge``) is listed first, not twice.
ALIASES = {
    "--nodes": "num_nodes",
    "--epochs": "num_train_epochs",
    "--lr": "learning_rate",
    "--batch-size": "per_device_train_batch_size",
    "--comp": "compression",
    "--straggler": "stragglers",
    "--leave": "absences",
    "--full-precision": "no_low_precision",
    "--default-malloc": "no_tune_cpu_malloc",
    "--kernel": "quant_kernel",
    "--final-merge": "final_merge",
    "--shard-column": "shard_column",
}


class Range(NamedTuple):
    """Allowed values ``low .. high`` (None: unbounded); ``*_open``: the bound itself is excluded."""

    low: float
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __str__(self) -> str:
        left, right = "(" if self.low_open else "[", ")" if self.high_open or self.high is None else "]"
        return f"{left}{self.low}, {'inf' if self.high is None else self.high}{right}"

    def __contains__(self, value) -> bool:
        above = value > self.low or (value == self.low and not self.low_open)
        below = self.high is None or value < self.high or (value == self.high and not self.high_open)
        return above and below


# Numeric TrainingArguments fields that transformers accepts with any value; the fields of
# DecentralizedTrainingArguments and of the recipes' dataclasses check themselves.
TRAINING_RANGES = {
    "learning_rate": Range(0, None, low_open=True),
    "num_train_epochs": Range(0, None, low_open=True),
    "per_device_train_batch_size": Range(1),
    "per_device_eval_batch_size": Range(1),
    "gradient_accumulation_steps": Range(1),
    "weight_decay": Range(0),
    "adam_beta1": Range(0, 1, high_open=True),
    "adam_beta2": Range(0, 1, high_open=True),
    "adam_epsilon": Range(0, None, low_open=True),
    "max_steps": Range(-1),
    "logging_steps": Range(0, None, low_open=True),
    "eval_steps": Range(0, None, low_open=True),
    "save_steps": Range(0, None, low_open=True),
    "save_total_limit": Range(1),
    "seed": Range(0, 2**32 - 1),
    "data_seed": Range(0, 2**32 - 1),
    "dataloader_num_workers": Range(0),
    "warmup_ratio": Range(0, 1),
}


def integer(text: str) -> int:
    """argparse type: a whole number written as one (``3``, not ``3.0`` or ``1e3``)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def finite_float(text: str) -> float:
    """argparse type: a finite float (NaN and +/-inf are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def ranged(kind, allowed: Range):
    """argparse type: ``integer`` or ``finite_float`` (``kind`` int or float) within ``allowed``."""
    parse = integer if kind is int else finite_float

    def parse_ranged(text):
        value = parse(text)
        if value not in allowed:
            raise argparse.ArgumentTypeError(f"must be in {allowed}, got {text}")
        return value
    return parse_ranged


def existing_path(text: str) -> str:
    """argparse type: a path that exists."""
    import pathlib

    if not pathlib.Path(text).exists():
        raise argparse.ArgumentTypeError(f"path {text!r} does not exist")
    return text


class OneLineErrors:
    """Mixin for argparse parsers: a bad flag is one line ``<prog>: error: <message>`` on stderr,
    exit status 2 (no usage dump, no traceback)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


class OneLineParser(OneLineErrors, argparse.ArgumentParser):
    """A plain ``argparse.ArgumentParser`` reporting bad flags as one line (:class:`OneLineErrors`)."""


class _FieldAdder:
    """What :class:`RecipeParser` hands to ``HfArgumentParser._parse_dataclass_field`` instead of
    the parser: adds the field's option with its aliases, strict number types and ranges, repeatable
    list flags (``--straggler a --straggler b``), and leaves out the fields the recipe fixes."""

    def __init__(self, target, ranges: dict, fixed: dict):
        self.target, self.ranges, self.fixed = target, ranges, fixed

    def add_argument(self, *option_strings, **kwargs):
        dest = kwargs.setdefault("dest", option_strings[0].lstrip("-"))
        if dest in self.fixed:
            return None
        names = {s.lstrip("-") for s in option_strings}
        aliases = [alias for alias, target in ALIASES.items() if target in names]
        kind = kwargs.get("type")
        if kind in (int, float):
            kwargs["type"] = ranged(kind, self.ranges[dest]) if dest in self.ranges else (
                integer if kind is int else finite_float)
        if kind is string_to_bool and "nargs" not in kwargs:  # an Optional[bool] field: the flag alone means True
            kwargs.update(nargs="?", const=True)
        if kwargs.get("action") == "store_false":  # HfArgumentParser's --no_<field> of a field defaulting to True
            kwargs.update(default=argparse.SUPPRESS, help=f"Set {dest} to False (see --{dest}).")
        if kwargs.get("nargs") == "+":  # list fields: the flag repeats, or lists several values
            kwargs.update(nargs="*", action="extend")
        return self.target.add_argument(*aliases, *(s for s in option_strings if s not in aliases), **kwargs)


class ParsedFlags(NamedTuple):
    """The result of :meth:`RecipeParser.parse`: the training arguments, the recipe's own
    arguments, the flags that belong to neither (``extras``), and every flag value by field name."""

    training: object
    recipe: object
    extras: argparse.Namespace
    values: dict

    def replace(self, **changes) -> ParsedFlags:
        """These flags with some values changed (by field name), both dataclasses rebuilt (and checked)."""
        values = {**self.values, **changes}
        built = [type(d)(**{f.name: values[f.name] for f in dataclasses.fields(d) if f.init and f.name in values})
                 for d in (self.training, self.recipe)]
        return ParsedFlags(*built, self.extras, values)


class RecipeParser(OneLineErrors, HfArgumentParser):
    """``HfArgumentParser`` over the recipe's dataclasses with the short :data:`ALIASES`,
    :data:`TRAINING_RANGES`, one-line errors and the dataclasses' own checks reported as flag errors.

    Args:
        training_class: :class:`~lp_decentral_nlp.trainer.DecentralizedTrainingArguments`.
        recipe_class: the recipe's own dataclass (e.g. :class:`~lp_decentral_nlp.commands.nlp.NLPArguments`).
        defaults: the recipe's defaults (shown by ``--help``), by field name.
        fixed: fields the recipe sets and that are not flags (e.g. ``{"algorithm": "choco"}``).
        derive: ``derive(values)`` completes the values of the flags (by field name) before the
            dataclasses are built, e.g. an output folder named after the run.
        value_checks: ``check(parser, values)`` run on the flag values before the dataclasses are
            built (building ``TrainingArguments`` under a launcher joins its process group).
        checks: ``check(parser, parsed)`` run after building, calling ``parser.error`` on bad input.
    """

    def __init__(self, training_class, recipe_class, *, defaults=None, fixed=None, derive=None, value_checks=(),
                 checks=(), **kwargs):
        self._fixed = dict(fixed or {})
        self._recipe_fields = {f.name for f in dataclasses.fields(recipe_class)}
        self._groups = None
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        kwargs.setdefault("usage", "%(prog)s [options]   (--help lists them; every TrainingArguments flag is accepted)")
        kwargs.setdefault("allow_abbrev", False)  # ~150 flags: a prefix must not silently pick one
        super().__init__((training_class, recipe_class), **kwargs)
        self.set_defaults(**(defaults or {}))
        self._derive, self._value_checks, self._checks = derive, list(value_checks), list(checks)
        #: the command line being parsed (set by :meth:`parse`)
        self.argv: list[str] = []

    def _parse_dataclass_field(self, parser, field):  # noqa: D401 -- HfArgumentParser's hook per field
        """Add one field's options, in the help's group: decentralized setting, recipe, or transformers'."""
        from transformers import TrainingArguments

        if self._groups is None:  # created in the order --help lists them
            self._groups = {"decentralized": self.add_argument_group("decentralized setting (SPEC 1-3, 6)"),
                            "recipe": self.add_argument_group("model, data and run"),
                            "transformers": self.add_argument_group("transformers TrainingArguments")}
        kind = ("recipe" if field.name in self._recipe_fields else "transformers"
                if field.name in {f.name for f in dataclasses.fields(TrainingArguments)} else "decentralized")
        HfArgumentParser._parse_dataclass_field(_FieldAdder(self._groups[kind], TRAINING_RANGES, self._fixed), field)

    def add_check(self, check) -> None:
        """Run ``check(parser, parsed)`` after every :meth:`parse`."""
        self._checks.append(check)

    def flag_of(self, name: str, argv=None) -> str:
        """The flag of field ``name`` as the user wrote it in ``argv`` (default: the command line being
        parsed), else its first spelling."""
        argv = self.argv if argv is None else argv
        for action in self._actions:
            if action.dest == name and action.option_strings:
                used = [s for s in action.option_strings if any(a == s or a.startswith(s + "=") for a in argv or ())]
                return (used or action.option_strings)[0]
        return name

    def parse(self, argv=None) -> ParsedFlags:
        """Parse ``argv`` (default ``sys.argv[1:]``) and build the dataclasses; a bad flag exits (status 2)."""
        import sys

        argv = list(sys.argv[1:] if argv is None else argv)
        self.argv = argv
        namespace = self.parse_args(argv)
        values = {**vars(namespace), **self._fixed}
        if self._derive is not None:
            self._derive(values)
        for check in self._value_checks:
            check(self, values)
        instances, used = [], set()
        for dtype in self.dataclass_types:
            names = {f.name for f in dataclasses.fields(dtype) if f.init}
            used |= names
            try:
                instances.append(dtype(**{k: v for k, v in values.items() if k in names}))
            except (ValueError, TypeError) as err:
                self.error(self._flag_message(str(err), argv))
        extras = argparse.Namespace(**{k: v for k, v in values.items() if k not in used})
        parsed = ParsedFlags(*instances, extras, values)
        for check in self._checks:
            check(self, parsed)
        return parsed

    def _flag_message(self, message: str, argv) -> str:
        """A dataclass's message prefixed with the flag of the field it starts with."""
        first = re.match(r"\w+", message)
        dests = {a.dest for a in self._actions if a.option_strings}
        if first and first.group(0) in dests:
            return f"argument {self.flag_of(first.group(0), argv)}: {message}"
        return message


def add_default_malloc_flag(parser) -> None:
    """``--default-malloc`` for the benchmarks: opt out of keeping freed memory on the CPU
    (``tune_cpu_malloc``, :mod:`lp_decentral_nlp.utils.cpu_malloc`); the recipes have it as the alias of
    ``--no_tune_cpu_malloc``."""
    parser.add_argument("--default-malloc", action="store_true",
                        help="CPU: keep glibc's default malloc policy, which returns freed memory to the system and "
                             "page-faults it in again every step (default: keep it for the next step, as "
                             "DecentralizedTrainer's tune_cpu_malloc does; see lp_decentral_nlp.utils.cpu_malloc)")
