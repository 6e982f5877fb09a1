"""The recipes' parser, :class:`RecipeParser` (needs transformers), and the flag table it generates.

:func:`render_flag_table` writes :mod:`.flag_table`, every flag of the NLP and vision recipes'
parsers (options, kind, allowed values, help with its default, group) and their descriptions, from
which :func:`.flags.check_flags` checks a command line before torch is imported. Regenerate it
after changing a flag, a dataclass field or transformers::

    python -m lp_decentral_nlp.commands.recipe_parser
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import pathlib
import pprint
import re

from transformers import HfArgumentParser
from transformers.hf_argparser import string_to_bool

from .flags import (ALIASES, RECIPE_USAGE, DefaultsHelpFormatter, FixedFieldFlag, FlagType, OneLineErrors,
                    ParsedFlags, option_used, options_given, fixed_field_reasons)

#: the text fields whose allowed values the flag types check: where those values are defined, by field name
#: (the dataclasses holding the fields check the same values on construction)
FIELD_CHOICES = {
    "topology": lambda: _values("lp_decentral_nlp.gossip.topology", "TOPOLOGIES"),
    "compressor": lambda: _values("lp_decentral_nlp.gossip.factory", "COMPRESSORS"),
    "backend": lambda: _values("lp_decentral_nlp.trainer.arguments", "BACKENDS"),
    "task": lambda: _values("lp_decentral_nlp.data.tasks", "TASKS"),
    "dataset": lambda: (*_values("lp_decentral_nlp.vision.data", "VISION_DATASETS"),
                        importlib.import_module("lp_decentral_nlp.vision.data").FOLDER),
    "arch": lambda: _values("lp_decentral_nlp.vision.models", "ARCHS"),
    "norm": lambda: ("auto", *_values("lp_decentral_nlp.vision.models", "NORMS")),  # auto: SPEC 5's pairing
    # a boolean or a word (TrainingArguments: True means "all", False "no")
    "include_num_input_tokens_seen": lambda: (True, False, "all", "non_padding", "no"),
}
# HfArgumentParser's types -> FlagType kinds (its Enum and Literal fields have a choice type of their own)
_KINDS = {int: "integer", float: "finite_float", string_to_bool: "boolean", str: "str"}


def _values(module: str, name: str) -> tuple:
    return tuple(getattr(importlib.import_module(module), name))


def field_choices() -> dict[str, tuple]:
    """The allowed values of each field of :data:`FIELD_CHOICES`, by field name."""
    return {name: values() for name, values in FIELD_CHOICES.items()}


#: list fields whose flag given alone (an empty list) has a meaning of its own
EMPTY_LIST_MEANS_SOMETHING = ("lr_milestones",)


class _FieldAdder:
    """What :class:`RecipeParser` hands to ``HfArgumentParser._parse_dataclass_field`` instead of
    the parser: adds the field's option with its aliases, a :class:`~.flags.FlagType` (strict
    numbers and booleans, the field's range and allowed values), repeatable list flags
    (``--straggler a --straggler b``), and leaves out the fields the recipe fixes. ``refusal``: the
    help of every option of a refused field (the reason it is refused), else None."""

    def __init__(self, target, allowed: dict, fixed: dict, refusal: str | None = None):
        self.target, self.allowed, self.fixed, self.refusal = target, allowed, fixed, refusal

    def add_argument(self, *option_strings, **kwargs):
        dest = kwargs.setdefault("dest", option_strings[0].lstrip("-"))
        if dest in self.fixed:  # refused, with the reason (:func:`~.flags.fixed_field_reasons`)
            return self.target.add_argument(*option_strings, dest=dest, action=FixedFieldFlag, reason=self.fixed[dest],
                                            default=argparse.SUPPRESS)
        names = {s.lstrip("-") for s in option_strings}
        aliases = [alias for alias, target in ALIASES.items() if target in names]
        kind = kwargs.get("type")
        if kind is string_to_bool and "nargs" not in kwargs:  # an Optional[bool] field: the flag alone means True
            kwargs.update(nargs="?", const=True)
        if getattr(kind, "__qualname__", "").startswith("make_choice_type_function"):  # an Enum or Literal field
            kwargs["type"] = FlagType("choice", dest, choices=kwargs["choices"])
        elif kind is string_to_bool and any(isinstance(v, str) for v in self.allowed.get(dest, ())):
            kwargs["type"] = FlagType("boolean_or_text", dest, self.allowed[dest])  # a `str | bool` field
        elif kind in _KINDS:
            kwargs["type"] = FlagType(_KINDS[kind], dest, self.allowed.get(dest))
        if kwargs.get("action") == "store_false":  # HfArgumentParser's --no_<field> of a field defaulting to True
            kwargs.update(default=argparse.SUPPRESS, help=f"Set {dest} to False (see --{dest}).")
        if kwargs.get("nargs") == "+":  # list fields: the flag repeats, or lists several values; alone it
            # is an error, but where an empty list means something (--lr_milestones alone: a constant LR)
            kwargs.update(nargs="*" if dest in EMPTY_LIST_MEANS_SOMETHING else "+", action="extend")
        if self.refusal is not None:
            kwargs["help"] = self.refusal
            if kwargs.get("type") is not None and not isinstance(kwargs["type"], FlagType):
                # transformers' own type (ParallelismConfig, dict[str, bool]) parses no text: any given value
                # reaches the refusal with its reason
                kwargs["type"] = FlagType("str", dest)
        return self.target.add_argument(*aliases, *(s for s in option_strings if s not in aliases), **kwargs)


class RecipeParser(OneLineErrors, HfArgumentParser):
    """``HfArgumentParser`` over the recipe's dataclasses with the short :data:`ALIASES`,
    :class:`~.flags.FlagType` flag types (each field's range and allowed values), one-line errors and the
    dataclasses' other checks reported as flag errors.

    Args:
        training_class: :class:`~lp_decentral_nlp.trainer.DecentralizedTrainingArguments`.
        recipe_class: the recipe's own dataclass (e.g. :class:`~lp_decentral_nlp.commands.nlp.NLPArguments`).
        defaults: the recipe's defaults (shown by ``--help``), by field name.
        fixed: fields the recipe sets and that are not flags (e.g. ``{"algorithm": "choco"}``).
        refused: fields the recipe refuses, by name, with the reason (its ``checks`` refuse them);
            ``--help`` lists them, and the fields ``DecentralizedTrainer`` refuses
            (:data:`~lp_decentral_nlp.trainer.field_policy.POLICY`), apart, each with its reason.
        derive: ``derive(values)`` completes the values of the flags (by field name) before the
            dataclasses are built, e.g. an output folder named after the run.
        value_checks: ``check(parser, values)`` run on the flag values before the dataclasses are
            built (building ``TrainingArguments`` under a launcher joins its process group).
        checks: ``check(parser, parsed)`` run after building, calling ``parser.error`` on bad input.
    """

    def __init__(self, training_class, recipe_class, *, defaults=None, fixed=None, refused=None, derive=None,
                 value_checks=(), checks=(), **kwargs):
        from ..trainer.field_policy import POLICY

        self._fixed = dict(fixed or {})
        self._refused = {**{name: treatment.removeprefix("refused: ") for name, treatment in POLICY.items()
                            if treatment.startswith("refused")}, **(refused or {})}
        self._allowed = field_choices()
        self._recipe_fields = {f.name for f in dataclasses.fields(recipe_class)}
        self._groups = None
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        kwargs.setdefault("usage", RECIPE_USAGE)
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
                            "transformers": self.add_argument_group("transformers TrainingArguments"),
                            "refused": self.add_argument_group(
                                "refused (transformers TrainingArguments these runs do not take: a value other "
                                "than the default is an error giving the reason shown)")}
        kind = ("refused" if field.name in self._refused else "recipe" if field.name in self._recipe_fields
                else "transformers" if field.name in {f.name for f in dataclasses.fields(TrainingArguments)}
                else "decentralized")
        adder = _FieldAdder(self._groups[kind], self._allowed, fixed_field_reasons(self.prog, self._fixed),
                            self._refused.get(field.name))
        HfArgumentParser._parse_dataclass_field(adder, field)

    def add_check(self, check) -> None:
        """Run ``check(parser, parsed)`` after every :meth:`parse`."""
        self._checks.append(check)

    def flag_of(self, name: str, argv=None) -> str:
        """The flag of field ``name`` as the user wrote it in ``argv`` (default: the command line being
        parsed; a field's negated flag, ``--no_<name>``, too), else its first spelling."""
        argv = self.argv if argv is None else argv
        actions = [action for action in self._actions if action.dest == name and action.option_strings]
        given = next((options_given(action, argv)[0] for action in actions if options_given(action, argv)), None)
        return given or (option_used(actions[0], argv) if actions else name)

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
        parsed = ParsedFlags(*instances, extras, values, {name: self.get_default(name) for name in values},
                             {a.dest: self.flag_of(a.dest, argv) for a in self._actions if a.option_strings})
        for check in self._checks:
            check(self, parsed)
        return parsed

    def _flag_message(self, message: str, argv) -> str:
        """A dataclass's message prefixed with the flag of the field it starts with."""
        first = re.match(r"\w+", message)
        dests = {a.dest for a in self._actions if a.option_strings}
        if first and first.group(0) in dests:
            # "data_dir: path ..." reads "argument --data-dir: path ...", not "... --data-dir: data_dir: path ..."
            name = first.group(0)
            return f"argument {self.flag_of(name, argv)}: {message.removeprefix(name + ': ')}"
        return message


def flag_table(parser: RecipeParser) -> dict:
    """Every flag of ``parser`` as :func:`.flags.check_flags` rebuilds it: options, destination,
    argparse action, group, help (with its default, as ``--help`` shows it), and for flags taking a
    value its :class:`~.flags.FlagType` kind and allowed values, nargs, const and choices. A flag of a
    type the table does not know (transformers' own classes) is kind ``"str"``: the real parser checks it."""
    action_names = {cls: name for name, cls in parser._registries["action"].items() if name is not None}
    formatter = parser._get_formatter()
    groups = {id(action): group.title for group in parser._action_groups for action in group._group_actions}
    flags = []
    for action in parser._actions:
        if isinstance(action, FixedFieldFlag):  # the check's parser refuses them from its own ``fixed``
            continue
        name = action_names[type(action)]
        if name == "help":
            continue
        flag = {"options": list(action.option_strings), "dest": action.dest, "action": name,
                "group": groups[id(action)],
                "help": formatter._expand_help(action).replace("%", "%%") if action.help and action.help.strip()
                else action.help}
        if name in ("store", "extend"):
            if action.type is not None:
                flag["type"] = action.type.kind if isinstance(action.type, FlagType) else "str"
                if isinstance(action.type, FlagType) and action.type.allowed is not None:
                    flag["allowed"] = list(action.type.allowed)
            flag.update({key: getattr(action, key) for key in ("nargs", "const") if getattr(action, key) is not None})
            if action.choices is not None:
                flag["choices"] = list(action.choices)
        if action.metavar is not None:
            flag["metavar"] = action.metavar
        if action.required:
            flag["required"] = True
        flags.append(flag)
    return {"usage": parser.usage, "groups": [group.title for group in parser._action_groups[2:]], "flags": flags}


def flag_tables() -> dict:
    """:func:`flag_table` of the NLP recipes' parser (with ``--task``) and of the vision recipes',
    with their descriptions by ``(task, algorithm)`` (task None: the vision recipes, or ``--task``)."""
    from ..data import TASKS
    from ..gossip.step_size import ALGORITHMS
    from ..vision.recipe import build_vision_parser
    from .nlp import build_nlp_parser

    return {
        "nlp": {**flag_table(build_nlp_parser(None, ALGORITHMS[0])),
                "descriptions": {(task, algorithm): build_nlp_parser(task, algorithm).description
                                 for task in (None, *TASKS) for algorithm in ALGORITHMS}},
        "vision": {**flag_table(build_vision_parser(ALGORITHMS[0])),
                   "descriptions": {(None, algorithm): build_vision_parser(algorithm).description
                                    for algorithm in ALGORITHMS}},
    }


FLAG_TABLE_PATH = pathlib.Path(__file__).with_name("flag_table.py")
FLAG_TABLE_DOC = ("Every flag of the recipes' parsers, for the flag check made before torch is imported "
                  "(lp_decentral_nlp.commands.flags.check_flags).\n\nGenerated from the parsers by "
                  "``python -m lp_decentral_nlp.commands.recipe_parser``; do not edit.\n")


def render_flag_table() -> str:
    """The text of :mod:`.flag_table` for the installed transformers and this package: every
    distinct list of choices once (``CHOICES``: the families' ``--optim`` and scheduler flags differ
    only in their defaults and share the long lists), every distinct flag once (``FLAGS``, choices
    as indices into ``CHOICES``; the families share most flags), each family's flags as indices
    into ``FLAGS``, and ``FLAG_TABLES`` with both filled in."""
    tables = flag_tables()
    choices: list[list] = []
    flags: list[dict] = []
    for table in tables.values():
        indices = []
        for flag in table["flags"]:
            if "choices" in flag:
                if flag["choices"] not in choices:
                    choices.append(flag["choices"])
                flag = {**flag, "choices": choices.index(flag["choices"])}
            if flag not in flags:
                flags.append(flag)
            indices.append(flags.index(flag))
        table["flags"] = indices
    return (f'"""{FLAG_TABLE_DOC}"""\n\nCHOICES = {pprint.pformat(choices, width=120, compact=True)}\n\n'
            f'FLAGS = {pprint.pformat(flags, width=120, sort_dicts=False)}\n\n'
            f'_TABLES = {pprint.pformat(tables, width=120, sort_dicts=False, compact=True)}\n\n\n'
            'def _flag(index: int) -> dict:\n'
            '    flag = FLAGS[index]\n'
            '    return {**flag, "choices": CHOICES[flag["choices"]]} if "choices" in flag else flag\n\n\n'
            'FLAG_TABLES = {family: {**table, "flags": [_flag(i) for i in table["flags"]]} '
            'for family, table in _TABLES.items()}\n')


if __name__ == "__main__":
    FLAG_TABLE_PATH.write_text(render_flag_table())
    print(f"wrote {FLAG_TABLE_PATH}")
