"""The recipes' flags: every ``TrainingArguments`` flag in the transformers spelling, plus short aliases,
and the flag check that runs before torch is imported. Imports only the standard library.

The command line is a :class:`~lp_decentral_nlp.commands.recipe_parser.RecipeParser` (an
``HfArgumentParser`` over :class:`~lp_decentral_nlp.trainer.DecentralizedTrainingArguments` and a
recipe's own small dataclass). Every check is defined once: every flag's value goes through a
:class:`FlagType`, which parses it (a number that is not a number, NaN/inf, an integer written as a
float, a boolean) and applies the field's range (:data:`lp_decentral_nlp.checks.NUMBER_FIELDS`) and
allowed values, the checks the dataclasses make on construction; the dataclasses' other checks
(combinations, files) are turned into the same one-line flag error by the parser.

:func:`check_flags` runs those flag types over a table of every flag of the recipes
(:mod:`.flag_table`, generated from the live parsers by :func:`.recipe_parser.render_flag_table`;
a test keeps it equal to them), so a bad flag, or ``--help``, is answered in a fraction of a
second; the recipes then build the real parser, which stays the source of truth.

Adding an alias is one line in :data:`ALIASES`.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
from typing import NamedTuple

from ..checks import CHOICE_CHECKS, ENTRY_PARSERS, NUMBER_FIELDS, check_choice, check_field, missing_path_problem, path_text

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
}

#: the recipes' usage line
RECIPE_USAGE = ("%(prog)s [options]   (--help lists them; every TrainingArguments flag is parsed, those under "
                "'refused' only at their default)")


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
    """argparse type: a path that exists, ``~`` expanded (:func:`user_path`)."""
    path = user_path(text)
    problem = missing_path_problem(path)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return path


def user_path(text: str) -> str:
    """argparse type: a path, ``~`` expanded (``checks.path_text``), for flags naming files or
    folders to write or read, so that ``--output-dir=~/runs`` lands where the shell's ``~`` would."""
    return path_text(text)


def boolean(text: str) -> bool:
    """argparse type: a boolean written yes/no, true/false, t/f, y/n or 1/0 (any case)."""
    if isinstance(text, bool):
        return text
    if text.lower() in ("yes", "true", "t", "y", "1"):
        return True
    if text.lower() in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false, yes/no, 1/0), got {text!r}")


def boolean_or_text(text: str) -> bool | str:
    """argparse type of a field that takes a boolean or a word (``include_num_input_tokens_seen``:
    ``all``, ``non_padding``, ``no`` or a boolean): a boolean spelling as :func:`boolean` reads it,
    else the text."""
    try:
        return boolean(text)
    except argparse.ArgumentTypeError:
        return text


#: how a flag's text is parsed, by kind (the kinds :class:`FlagType` and the flag table know)
FLAG_KINDS = {"integer": integer, "finite_float": finite_float, "boolean": boolean, "boolean_or_text": boolean_or_text,
              "str": str}


class FlagType:
    """argparse type of a recipe flag: the text parsed as ``kind`` (:data:`FLAG_KINDS`; ``"choice"``:
    one of ``choices``, given as text), then the checks of field ``dest``: its range in
    :data:`~lp_decentral_nlp.checks.NUMBER_FIELDS` and, with ``allowed``, its allowed values -- the
    checks (and messages) of the dataclass that holds the field."""

    def __init__(self, kind: str, dest: str, allowed=None, choices=None):
        if kind == "choice":
            by_text = {str(choice): choice for choice in choices}
            self.parse = lambda text: by_text.get(text, text)  # argparse then checks the choices
        elif kind in FLAG_KINDS:
            self.parse = FLAG_KINDS[kind]
        else:
            raise ValueError(f"kind must be one of {(*FLAG_KINDS, 'choice')}, got {kind!r}")
        self.kind, self.dest = kind, dest
        self.allowed = None if allowed is None else tuple(allowed)
        self.__name__ = getattr(self.parse, "__name__", kind)  # argparse's "invalid <name> value" message

    def __call__(self, text):
        value = self.parse(text)
        try:
            if self.kind in ("integer", "finite_float") and self.dest in NUMBER_FIELDS:
                check_field(self.dest, value)
            if self.dest in ENTRY_PARSERS:  # the dataclass's message, which names the field
                try:
                    ENTRY_PARSERS[self.dest](value)
                except ValueError as err:
                    raise ValueError(f"{self.dest}: {err}") from None
            if self.allowed is not None:
                CHOICE_CHECKS.get(self.dest, check_choice)(self.dest, value, self.allowed)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return value


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each flag's default, as :class:`argparse.ArgumentDefaultsHelpFormatter`
    shows it, except where the help already says what the default is (``(default: ...)``,
    ``(default 8)``, ``...; default: none``): there the value argparse holds (often ``None``,
    resolved later) would contradict it."""

    def _get_help_string(self, action):
        if action.help and re.search(r"[(;]\s*default\b", action.help):
            return action.help
        return super()._get_help_string(action)


class OneLineErrors:
    """Mixin for argparse parsers: a bad flag is one line ``<prog>: error: <message>`` on stderr,
    exit status 2 (no usage dump, no traceback), under a launcher once per machine
    (:func:`.run.leave_refusal_report_to_first_process`). Flags are spelt in full (no prefixes), and
    one given twice is refused. A bad value is told behind the spelling of the flag
    the user wrote (``argument --lr: ...``, not every alias of it)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("exit_on_error", False)  # parse_known_args below reports the error
        # a prefix (--batch for --batch-size) would escape the check of a flag given twice
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        # a value starting with a minus and a digit is a value, not an unknown flag: --leave -1:0:2 is
        # refused for its node (argparse took -1:0:2 for an option: "expected at least one argument")
        self._negative_number_matcher = re.compile(r"^-\d[\d.:eE+-]*$")

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        self._refuse_repeated_flags(args)
        try:
            return super().parse_known_args(args, namespace)
        except argparse.ArgumentError as err:  # its argument_name is "/".join(the action's option_strings)
            action = next((a for a in self._actions
                           if a.option_strings and "/".join(a.option_strings) == err.argument_name), None)
            self.error(str(err) if action is None else f"argument {option_used(action, args)}: {err.message}")

    def error(self, message):
        from .run import leave_refusal_report_to_first_process  # the standard library only, as this module

        message = " ".join(line.strip() for line in message.splitlines() if line.strip())  # transformers' span lines
        leave_refusal_report_to_first_process()
        self.exit(2, f"{self.prog}: error: {message}\n")

    def flag_given(self, name: str, argv=None) -> str | None:
        """The option that sets field ``name`` as ``argv`` (default: the command line a
        :class:`~.recipe_parser.RecipeParser` is parsing) gives it (an alias such as
        ``--full-precision`` included), else None."""
        argv = getattr(self, "argv", None) if argv is None else argv
        given = [option for action in self._actions if action.dest == name for option in options_given(action, argv)]
        return given[0] if given else None

    def set_help(self, name: str, text: str) -> None:
        """Replace the help of the flags that set ``name`` (e.g. ``--low_precision`` and
        ``--full-precision``), for a program whose default or meaning differs from the field's
        (KeyError when no flag sets ``name``)."""
        actions = [a for a in self._actions if a.dest == name and a.option_strings]
        if not actions:
            raise KeyError(f"no flag sets {name!r}")
        for action in actions:
            action.help = text

    # actions a flag may be given to more than once (each occurrence adds)
    _REPEATABLE = (argparse._AppendAction, argparse._AppendConstAction, argparse._CountAction,
                   argparse._ExtendAction)

    def _refuse_repeated_flags(self, args) -> None:
        """A flag given twice, itself or by an alias (``--nodes 2 --num_nodes 3``), is an error:
        argparse would keep the last value and drop the other in silence. Repeatable flags
        (``append``: ``--straggler``) may repeat."""
        by_option = {option: action for action in self._actions if not isinstance(action, self._REPEATABLE)
                     for option in action.option_strings}
        seen: dict[str, str] = {}
        for token in args:
            if token == "--":
                break
            option = token.split("=", 1)[0]
            action = by_option.get(option)
            if action is None:
                continue
            if action.dest in seen:
                self.error(f"argument {option}: given more than once ({seen[action.dest]} and {option}): give it once")
            seen[action.dest] = option


def options_given(action: argparse.Action, argv) -> list[str]:
    """The options of ``action`` that ``argv`` uses (``--lr`` or ``--lr=...``), in its order of options."""
    return [s for s in action.option_strings if any(a == s or a.startswith(s + "=") for a in argv or ())]


def option_used(action: argparse.Action, argv) -> str:
    """The option of ``action`` that ``argv`` uses (``--lr`` or ``--lr=...``), else its first one
    spelt with dashes (``--data-dir``, the spelling the docs use), else its first one."""
    dashed = sorted(action.option_strings, key=lambda option: "_" in option)  # stable: the first dashed one first
    return (options_given(action, argv) or dashed or [action.dest])[0]


class OneLineParser(OneLineErrors, argparse.ArgumentParser):
    """A plain ``argparse.ArgumentParser`` reporting bad flags as one line (:class:`OneLineErrors`)."""


class ParsedFlags(NamedTuple):
    """The result of :meth:`RecipeParser.parse`: the training arguments, the recipe's own
    arguments, the flags that belong to neither (``extras``), every flag value by field name, the
    parser's default of each of them (the recipe's, where it sets one), and the flag that names
    each field in messages (as the command line spelt it, else its first spelling)."""

    training: object
    recipe: object
    extras: argparse.Namespace
    values: dict
    defaults: dict
    flags: dict

    def replace(self, **changes) -> ParsedFlags:
        """These flags with some values changed (by field name), both dataclasses rebuilt (and checked)."""
        values = {**self.values, **changes}
        built = [type(d)(**{f.name: values[f.name] for f in dataclasses.fields(d) if f.init and f.name in values})
                 for d in (self.training, self.recipe)]
        return ParsedFlags(*built, self.extras, values, self.defaults, self.flags)


def check_flags(family: str, argv=None, *, fixed: dict[str, str] | None = None, description: str | None = None,
                prog: str | None = None):
    """Check a recipe's command line against the flag table, without importing torch or transformers:
    ``flag_check_parser(family, ...).parse_args(argv)``.

    A bad flag exits as the recipe's parser would (one line ``<prog>: error: <message>``, status 2),
    and so does an unusable launcher or thread variable (:func:`.run.environment_problem`): OpenMP
    reads ``OMP_NUM_THREADS`` as torch loads, and would print its own complaint first.
    ``--help`` prints the recipe's help and exits (status 0). Returns the parsed flags (only those
    given) when they pass; the caller then runs the real parser, which also makes the checks that
    need the libraries (combinations of flags, files, the launcher).

    Args:
        family: ``"nlp"`` or ``"vision"`` (:data:`.flag_table.FLAG_TABLES`).
        argv: the arguments (default ``sys.argv[1:]``).
        fixed: ``{field: reason}`` of the fields the recipe sets itself, which are not flags (e.g.
            ``algorithm``): given anyway, each is refused with its reason.
        description: the recipe's description, shown by ``--help``.
        prog: the program name (default: argparse's, the script's file name).
    """
    parser = flag_check_parser(family, fixed=fixed, description=description, prog=prog)
    parsed = parser.parse_args(sys.argv[1:] if argv is None else argv)
    from .run import environment_problem  # the standard library only, as this module

    problem = environment_problem()
    if problem:
        parser.error(problem)
    return parsed


def fixed_field_reasons(prog: str, fixed: dict[str, str]) -> dict[str, str]:
    """Why the recipe ``prog`` refuses the flag of each field it sets itself, by field (``fixed``:
    their values, e.g. ``{"algorithm": "choco", "task": "ag_news"}``): it runs that one, another
    is another recipe's."""
    reasons = {name: f"{prog} sets it to {value!r}" for name, value in fixed.items()}
    algorithm = fixed.get("algorithm")
    if algorithm in ("choco", "deepsqueeze"):
        other = "deepsqueeze" if algorithm == "choco" else "choco"
        sibling = prog.replace(algorithm, other) if algorithm in prog else f"the {other} recipe"
        reasons["algorithm"] = f"{prog} runs {algorithm}: run {sibling} for {other}"
    if "task" in fixed:
        reasons["task"] = (f"{prog} trains the {fixed['task']} task: each task has its recipes (recipes/agnews_*.py, "
                           "sentlen_*.py, and text_*.py for your own data)")
    return reasons


class FixedFieldFlag(argparse.Action):
    """The flag of a field the command sets itself: refused, one line naming it, whatever its value."""

    def __init__(self, option_strings, dest, reason: str, **kwargs):
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"argument {option_string}: {self.reason}")


def flag_check_parser(family: str, *, fixed: dict[str, str] | None = None, description: str | None = None,
                      prog: str | None = None, epilog: str | None = None):
    """The torch-free parser :func:`check_flags` runs: every flag of the ``family``'s table (all
    defaults suppressed, so it returns only the flags given). A command with flags of its own
    (``recipes/sweep.py``) adds them to it before parsing, and may give an ``epilog`` that
    ``--help`` prints after the flags, its lines kept. Other arguments as for :func:`check_flags`."""
    from .flag_table import FLAG_TABLES

    if family not in FLAG_TABLES:
        raise ValueError(f"family must be one of {tuple(FLAG_TABLES)}, got {family!r}")
    table = FLAG_TABLES[family]
    keep_lines = epilog is not None  # the epilog's lines as written (the description is one line)
    parser = OneLineParser(prog=prog, usage=table["usage"], description=description, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter if keep_lines else argparse.HelpFormatter)
    groups = {title: parser.add_argument_group(title) for title in table["groups"]}
    reasons = fixed or {}
    for name, reason in reasons.items():  # (the table may list no flag for a field every recipe sets)
        options = next((flag["options"] for flag in table["flags"] if flag["dest"] == name), [f"--{name}"])
        parser.add_argument(*options, dest=name, action=FixedFieldFlag, reason=reason, default=argparse.SUPPRESS)
    for flag in table["flags"]:
        if flag["dest"] in reasons:
            continue
        kwargs = {key: flag[key] for key in ("dest", "help", "action", "nargs", "const", "choices", "metavar",
                                              "required") if key in flag}
        if "type" in flag:
            kwargs["type"] = FlagType(flag["type"], flag["dest"], flag.get("allowed"), flag.get("choices"))
        groups[flag["group"]].add_argument(*flag["options"], default=argparse.SUPPRESS, **kwargs)
    return parser


def __getattr__(name: str):
    if name == "RecipeParser":  # needs transformers: imported on first use
        from .recipe_parser import RecipeParser

        return RecipeParser
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def device(text: str) -> str:
    """A ``--device`` value: ``cpu``, or ``cuda`` where torch sees a CUDA device."""
    if text not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu or cuda, got {text!r}")
    import torch

    if text == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"cuda: torch {torch.__version__} sees no CUDA device here; use cpu")
    return text


def add_device_flag(parser) -> None:
    """``--device {cpu,cuda}`` for the benchmarks, default cuda where available."""
    import torch

    parser.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (default: cuda where available)")


def add_threads_flag(parser, default, help: str) -> None:
    """``--threads N`` for the benchmarks: torch intra-op threads, from 1 to this machine's cores (as
    the recipes' ``--threads``)."""
    parser.add_argument("--threads", type=ranged(int, Range(1, os.cpu_count() or 1)), default=default, help=help)


def add_default_malloc_flag(parser) -> None:
    """``--default-malloc`` for the benchmarks: opt out of keeping freed memory on the CPU
    (``tune_cpu_malloc``, :mod:`lp_decentral_nlp.utils.cpu_malloc`); the recipes have it as the alias of
    ``--no_tune_cpu_malloc``."""
    parser.add_argument("--default-malloc", action="store_true",
                        help="CPU: keep glibc's default malloc policy, which returns freed memory to the system and "
                             "page-faults it in again every step (default: keep it for the next step, as "
                             "DecentralizedTrainer's tune_cpu_malloc does; see lp_decentral_nlp.utils.cpu_malloc)")
