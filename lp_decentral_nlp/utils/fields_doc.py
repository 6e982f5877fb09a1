"""``help()`` text for the argument dataclasses, whose fields carry their ``--flag`` help in
``field(metadata={"help": ...})`` (as transformers' ``TrainingArguments`` does): an ``Args``
section appended to the class docstring, so ``help(cls)`` explains each field."""
from __future__ import annotations

import inspect
import textwrap
from dataclasses import MISSING, fields


def document_fields(heading: str, inherited: bool = True):
    """Class decorator (outside ``@dataclass``): append ``Args (<heading>):`` and one entry per
    field, ``name (type, default value): help``, to the docstring; ``inherited=False`` lists only
    the fields the class itself declares (those of a base with its own help are left to it)."""

    def decorate(cls):
        own = inspect.get_annotations(cls)
        lines = ["", *textwrap.wrap(f"Args ({heading}):", width=96, initial_indent=" " * 4, subsequent_indent=" " * 4)]
        for f in fields(cls):
            if f.init and (inherited or f.name in own):
                default = f.default if f.default is not MISSING else f.default_factory()
                entry = f"{f.name} ({f.type}, default {default!r}): {f.metadata.get('help', '').replace('%%', '%')}"
                lines += textwrap.wrap(entry, width=100, initial_indent=" " * 8, subsequent_indent=" " * 12)
        cls.__doc__ = (cls.__doc__ or cls.__name__).rstrip() + "\n" + "\n".join(lines) + "\n"
        return cls

    return decorate
