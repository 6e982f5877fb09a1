"""The one set of range checks of the numeric settings, shared by the library and the command lines.

:data:`NUMBER_FIELDS` gives the allowed values of every numeric field of
:class:`~lp_decentral_nlp.trainer.DecentralizedTrainingArguments` (the ``TrainingArguments`` fields
transformers accepts with any value, and the decentralized setting of SPEC sections 1-3 and 6),
of :class:`~lp_decentral_nlp.gossip.GossipConfig` and of the recipes' own arguments.
:func:`check_field` is what those dataclasses call in ``__post_init__`` and what the recipes'
flag types call on a parsed value (:mod:`lp_decentral_nlp.commands.flags`), so a bad value gives
the same message from either. This module imports only the standard library: the recipes check
their flags with it before torch is imported.
"""
from __future__ import annotations

import math
import numbers
import os
from collections.abc import Hashable
import sys
from typing import NamedTuple


class Number(NamedTuple):
    """Allowed values of a numeric setting: ``low .. high`` (None: unbounded; ``*_open``: the bound
    itself is excluded), an int if ``integer`` (a float setting also takes an int), None allowed if
    ``optional``. ``what`` names the kind of value in the message (default "an integer"/"a number")."""

    integer: bool = False
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    optional: bool = False
    what: str | None = None

    def describe(self) -> str:
        """``"an integer in [1, 65536]"``, ``"a number > 0"``, ..."""
        what = self.what or ("an integer" if self.integer else "a number")
        if self.low is not None and self.high is not None:
            return (f"{what} in {'(' if self.low_open else '['}{_show(self.low)}, {_show(self.high)}"
                    f"{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{what} {'>' if self.low_open else '>='} {_show(self.low)}"
        if self.high is not None:
            return f"{what} {'<' if self.high_open else '<='} {_show(self.high)}"
        return what

    def admits(self, value) -> bool:
        """Whether ``value`` is a finite number within these bounds: an int (any integral type:
        Python's or NumPy's) if ``integer``, else any real number; never a bool (NumPy's bool is not a
        number to :mod:`numbers` either); None if ``optional``."""
        if value is None:
            return self.optional
        kind = numbers.Integral if self.integer else numbers.Real
        if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value):
            return False
        low, high = self.low, self.high
        return not (low is not None and (value <= low if self.low_open else value < low)) and \
            not (high is not None and (value >= high if self.high_open else value > high))


#: the two most common kinds of count: at least one (sizes, classes) and at least zero (steps, padding)
POSITIVE_INT, NONNEGATIVE_INT = Number(integer=True, low=1), Number(integer=True, low=0)


def plain_number(value):
    """``value`` as Python's own int or float (a NumPy scalar converted; None, int and float as they
    are), so that settings hold numbers that JSON, argparse and ``repr`` treat as usual."""
    if value is None or type(value) in (int, float):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _show(bound) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


_BIG = 2**40  # more steps than any run makes
_SEED = Number(integer=True, low=0, high=2**32 - 1)  # numpy's seed range (transformers.set_seed seeds numpy)

#: allowed values of every numeric setting, by field name
NUMBER_FIELDS: dict[str, Number] = {
    # TrainingArguments fields that transformers accepts with any value
    "per_device_train_batch_size": Number(integer=True, low=1, high=2**24),
    "per_device_eval_batch_size": Number(integer=True, low=1, high=2**24),
    "gradient_accumulation_steps": Number(integer=True, low=1, high=2**20),
    "max_steps": Number(integer=True, low=-1, high=_BIG),
    "num_train_epochs": Number(low=0, low_open=True, high=1e6),
    "learning_rate": Number(low=0, low_open=True, high=1e4),
    "weight_decay": Number(low=0, high=1e4),
    "adam_beta1": Number(low=0, high=1, high_open=True),
    "adam_beta2": Number(low=0, high=1, high_open=True),
    "adam_epsilon": Number(low=0, low_open=True, high=1),
    "max_grad_norm": Number(low=0, high=1e12),
    "label_smoothing_factor": Number(low=0, high=1, high_open=True),
    "warmup_steps": Number(low=0, high=_BIG),
    "logging_steps": Number(low=0, low_open=True, high=_BIG),
    "save_steps": Number(low=0, low_open=True, high=_BIG),
    "eval_steps": Number(low=0, low_open=True, high=_BIG, optional=True),
    "eval_delay": Number(low=0, high=_BIG),
    "save_total_limit": Number(integer=True, low=1, high=2**20, optional=True),
    "seed": _SEED,
    "data_seed": _SEED._replace(optional=True),
    "dataloader_num_workers": Number(integer=True, low=0, high=1024),
    "dataloader_prefetch_factor": Number(integer=True, low=1, high=1024, optional=True),
    "neftune_noise_alpha": Number(low=0, low_open=True, high=1e4, optional=True),
    # the decentralized setting (SPEC 1-3, 6)
    "num_nodes": Number(integer=True, low=1, high=65536),  # the mixing matrices are dense n x n
    "torus_rows": Number(integer=True, low=1, high=65536, optional=True),
    "compression": Number(low=0, high=100, high_open=True, what="a percentage"),
    "qsgd_levels": Number(integer=True, low=1, high=127),
    "consensus_lr": Number(low=0, low_open=True, high=1, optional=True),
    "skew": Number(low=0, high=1),
    "qgm_beta": Number(low=0, high=1, high_open=True),
    "lr_decay": Number(low=0, low_open=True, high=1),
    "gossip_timeout": Number(low=0, low_open=True, what="a number of seconds"),
    "drop_prob": Number(low=0, high=1, high_open=True, what="a probability"),
    # the recipes' own arguments
    "threads": Number(integer=True, low=1, high=os.cpu_count() or 1, optional=True),  # this machine's cores
    "max_length": Number(integer=True, low=2, high=1_000_000),
    "max_train_samples": Number(integer=True, low=1, optional=True),
    "max_eval_samples": Number(integer=True, low=1, optional=True),
    "image_size": Number(integer=True, low=1, optional=True),  # None: the dataset's
    "groups": Number(integer=True, low=1),
}


def check_number(name: str, value, allowed: Number):
    """``value`` as a plain Python number (:func:`plain_number`) if ``allowed`` admits it
    (:meth:`Number.admits`: NumPy numbers too), else ValueError
    ``"<name> must be <allowed.describe()>, got <value!r>"``."""
    if not allowed.admits(value):
        raise ValueError(f"{name} must be {allowed.describe()}, got {value!r}")
    return plain_number(value)


def check_field(name: str, value):
    """:func:`check_number` of setting ``name`` against its :data:`NUMBER_FIELDS` entry."""
    return check_number(name, value, NUMBER_FIELDS[name])


def check_fields(obj, names) -> None:
    """:func:`check_field` of each attribute ``names`` of ``obj``, in order (the first bad one
    raises); a NumPy number is stored back as Python's (frozen dataclasses included)."""
    for name in names:
        value = getattr(obj, name)
        plain = check_field(name, value)
        if plain is not value:
            object.__setattr__(obj, name, plain)


def check_flag(name: str, value) -> bool:
    """``value`` as Python's own bool if it is a bool (NumPy's ``np.bool_`` too, as
    :func:`check_number` takes NumPy numbers), else ValueError ``"<name> must be True or False,
    got <value!r>"``: a string such as ``"no"`` or ``"false"`` is truthy and would switch the
    setting on."""
    numpy = sys.modules.get("numpy")  # (not imported here: the flag checks run before torch and NumPy load)
    if not (isinstance(value, bool) or (numpy is not None and isinstance(value, numpy.bool_))):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_flags(obj, names) -> None:
    """:func:`check_flag` of each attribute ``names`` of ``obj``, in order (the first bad one
    raises); a NumPy bool is stored back as Python's (frozen dataclasses included)."""
    for name in names:
        object.__setattr__(obj, name, check_flag(name, getattr(obj, name)))


def check_choice(name: str, value, allowed) -> None:
    """ValueError ``"<name> must be one of <allowed>, got <value!r>"`` unless ``value in allowed``
    (an unhashable value, e.g. an array, is refused too, not compared entry by entry)."""
    if not isinstance(value, Hashable) or value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")


#: the file suffixes a topology given as a file of mixing matrices may have (``Topology.from_file``)
TOPOLOGY_FILE_SUFFIXES = (".npy", ".json")


def path_text(value):
    """A path setting as text, what is saved and compared: a ``str`` or ``os.PathLike`` as a ``str``
    with ``~`` expanded (as ``TrainingArguments`` expands ``output_dir``; the shell leaves it as
    typed after ``--flag=``); anything else as given (None, a name such as a topology's or a hub
    id, which expansion leaves alone, or a value the checks refuse)."""
    return os.path.expanduser(value) if isinstance(value, (str, os.PathLike)) else value


def missing_path_problem(path: str) -> str | None:
    """Why the path `path` (text, ``~`` already expanded) names nothing to read, or None:
    ``"path '...' does not exist"``, a broken symbolic link said so. (``os.path.exists``, unlike
    ``pathlib.Path.exists``, answers False for a name the file system refuses, e.g. one too long.)"""
    if os.path.exists(path):
        return None
    return f"path {path!r} does not exist" + (" (a broken symbolic link)" if os.path.islink(path) else "")


def checked_existing_path(name: str, value):
    """`value` (a path setting, or None) as :func:`path_text`; ValueError ``"<name>: path ... does not
    exist"`` (:func:`missing_path_problem`) for a path that names nothing."""
    value = path_text(value)
    problem = None if value is None else missing_path_problem(value)
    if problem:
        raise ValueError(f"{name}: {problem}")
    return value


def check_topology_name_or_file(name: str, value, topologies) -> None:
    """ValueError unless ``value`` is one of ``topologies`` or the path of an existing file ending in
    one of :data:`TOPOLOGY_FILE_SUFFIXES` (the matrices it holds are checked when it is read:
    ``Topology.from_file``)."""
    if isinstance(value, (str, os.PathLike)) and os.fspath(value).lower().endswith(TOPOLOGY_FILE_SUFFIXES):
        if not os.path.isfile(os.path.expanduser(value)):  # ~ as the shell leaves it after --topology=
            raise ValueError(f"{name}: no file {os.fspath(value)!r} (a graph of your own: a .npy or .json file of "
                             "its mixing matrices)")
        return
    if not isinstance(value, Hashable) or value not in topologies:
        raise ValueError(f"{name} must be one of {tuple(topologies)} or a .npy or .json file of mixing matrices "
                         f"(a graph of your own), got {value!r}")


def check_data_dir_given(task: str, data_dir) -> None:
    """ValueError ``"data_dir: the text task trains on your own data: give ..."`` (what it reads)
    when ``task`` is ``"text"`` and ``data_dir`` is None: the one task without data of its own
    (:func:`lp_decentral_nlp.data.load_task`, the recipes' ``--data-dir``)."""
    if task == "text" and data_dir is None:
        raise ValueError("data_dir: the text task trains on your own data: give a CSV file with text,label columns, "
                         "a folder of train.csv (and test.csv, validation.csv), or a DatasetDict.save_to_disk folder")


# Fault-injection entries (lp_decentral_nlp.gossip.faults), parsed here so that the recipes check
# their --straggler / --leave values before torch is imported.
def parse_straggler(text: str) -> tuple[int, float]:
    """``"NODE:SECONDS"`` -> ``(node, seconds)``; ValueError naming the expected form."""
    parts = str(text).split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        node, seconds = int(parts[0]), float(parts[1])
    except ValueError:
        raise ValueError(f"expected NODE:SECONDS (e.g. 2:0.5), got {text!r}") from None
    if node < 0 or not math.isfinite(seconds) or seconds <= 0:  # 0 s would delay nothing, yet be reported
        raise ValueError(f"expected NODE:SECONDS with NODE >= 0 and finite SECONDS > 0, got {text!r}")
    return node, seconds


def parse_absence(text: str) -> tuple[int, int, int]:
    """``"NODE:START:END"`` -> ``(node, start, end)``; ValueError naming the expected form."""
    parts = str(text).split(":")
    try:
        if len(parts) != 3:
            raise ValueError
        node, start, end = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"expected NODE:START:END (e.g. 1:100:200), got {text!r}") from None
    if node < 0 or start < 0 or end <= start:
        raise ValueError(f"expected NODE:START:END with NODE >= 0 and 0 <= START < END, got {text!r}")
    return node, start, end


#: text fields that take one of their allowed values or something else, by field name: the check
#: of one value (the others take one of their allowed values: :func:`check_choice`)
CHOICE_CHECKS = {"topology": check_topology_name_or_file}

#: list fields whose entries have a textual form, by field name: the parser of one entry
ENTRY_PARSERS = {"stragglers": parse_straggler, "absences": parse_absence}
