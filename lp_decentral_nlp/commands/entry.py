"""The recipes' entry point: the flag check first (no torch), then the run.

``recipe_main("nlp", "choco", task="ag_news")`` is what ``recipes/agnews_choco.py`` runs: a bad flag
or ``--help`` is answered by :func:`.flags.check_flags` from the flag table (which also refuses an
unusable launcher or thread variable), before torch and transformers are imported; flags that
pass go to the recipe's ``main`` (:func:`.nlp.main`, :func:`lp_decentral_nlp.vision.recipe.main`),
whose parser checks them again, and the rest.
"""
from __future__ import annotations

import contextlib
import os
import sys

from .flags import check_flags, fixed_field_reasons

RECIPE_FAMILIES = ("nlp", "vision")


def recipe_main(family: str, algorithm: str, task: str | None = None, argv: list[str] | None = None) -> dict:
    """Run a recipe: ``family`` ``"nlp"`` (``task`` one of the NLP tasks, or None for a ``--task``
    flag) or ``"vision"`` (no ``task``), gossip ``algorithm``; ``argv`` default ``sys.argv[1:]``.
    Returns the run's results (``results.json``). Under a launcher, the process group the run's
    arguments joined is left as :func:`leaving_joined_process_group` says; one initialised before
    the call stays the caller's."""
    from .flag_table import FLAG_TABLES

    if family not in RECIPE_FAMILIES:
        raise ValueError(f"family must be one of {RECIPE_FAMILIES}, got {family!r}")
    if family == "vision" and task is not None:
        raise ValueError(f"task: the vision recipes take --dataset, not a task, got task={task!r}")
    descriptions = FLAG_TABLES[family]["descriptions"]
    if (task, algorithm) not in descriptions:
        known = sorted({t for t, _ in descriptions if t is not None}) if family == "nlp" else []
        raise ValueError(f"algorithm must be one of {sorted({a for _, a in descriptions})}"
                         + (f" and task one of {known} or None" if known else "") + f", got {algorithm!r}, {task!r}")
    fixed = {"algorithm": algorithm} if task is None else {"algorithm": algorithm, "task": task}
    prog = os.path.basename(sys.argv[0])
    check_flags(family, argv, fixed=fixed_field_reasons(prog, fixed), description=descriptions[task, algorithm])
    from .run import stop_on_interrupt

    with leaving_joined_process_group(), stop_on_interrupt(
            os.path.basename(sys.argv[0]),
            "the run did not finish: run it again (with --overwrite_output_dir once its output folder holds files)"):
        if family == "vision":
            from ..vision.recipe import main as vision_main

            return vision_main(algorithm, argv)
        from .nlp import main as nlp_main

        return nlp_main(task, algorithm, argv)


# how a run may stop with its process group safe to destroy: finished, refused (nothing was sent)
# or stopped on SIGTERM (every process checkpointed the same step, nothing is in flight)
EXITS_THAT_LEAVE_THE_GROUP = (0, 2, 143)


@contextlib.contextmanager
def leaving_joined_process_group():
    """Destroy the process group that the block joined (a launcher's, which the run's arguments
    join) when the block ends with one of :data:`EXITS_THAT_LEAVE_THE_GROUP`, the interpreter's
    shutdown being where a gloo group can abort a finished process (SIGABRT, "terminate called
    without an active exception"; pytorch/pytorch#190489). A group initialised before the block is
    left alone, and so is one after any other end (a failed gossip or Ctrl-C can leave a receive
    pending, which destroying the group would wait for)."""
    import torch.distributed as dist

    may_join = dist.is_available() and not dist.is_initialized()
    exit_code = None
    try:
        yield
        exit_code = 0
    except SystemExit as stop:
        exit_code = stop.code
        raise
    finally:
        if may_join and exit_code in EXITS_THAT_LEAVE_THE_GROUP and dist.is_initialized():
            dist.destroy_process_group()
