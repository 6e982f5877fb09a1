"""The command lines: the recipes' shared flags and run contract, and the NLP and vision recipes.

* :mod:`.flags` -- :class:`RecipeParser` (``HfArgumentParser`` with short aliases, strict numbers
  and one-line errors), :data:`ALIASES`, :func:`ranged`, :func:`existing_path`.
* :mod:`.run` -- checks made before a run (launcher, output folder, model folder, memory), the
  thread default and the results contract (``results.json``, ``cost_report.json``).
* :mod:`.nlp` -- the NLP recipes (``main(task, algorithm)``).

The vision recipes' command line is :mod:`lp_decentral_nlp.vision.recipe`; the cost command line
``python -m lp_decentral_nlp.cost``.
"""
from .flags import (ALIASES, TRAINING_RANGES, OneLineErrors, OneLineParser, ParsedFlags, Range, RecipeParser,
                    add_default_malloc_flag, existing_path, finite_float, integer, ranged)
from .nlp import DEFAULT_MODEL, NLPArguments, build_nlp_parser, main, resolve_model, run_nlp
from .run import RunArguments, finished_results, packaged_model_path, run_config, train_and_report

__all__ = ["ALIASES", "TRAINING_RANGES", "OneLineErrors", "OneLineParser", "ParsedFlags", "Range", "RecipeParser",
           "add_default_malloc_flag", "existing_path", "finite_float", "integer", "ranged", "DEFAULT_MODEL",
           "NLPArguments", "build_nlp_parser", "main", "resolve_model", "run_nlp", "RunArguments",
           "finished_results", "packaged_model_path", "run_config", "train_and_report"]
