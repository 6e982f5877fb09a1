"""The command lines: the recipes' shared flags and run contract, and the NLP and vision recipes.

* :mod:`.flags` -- :data:`ALIASES`, the flag types (:class:`FlagType`, :func:`ranged`,
  :func:`existing_path` ...), one-line errors, and :func:`check_flags`, the flag check made
  before torch is imported (from the generated :mod:`.flag_table`).
* :mod:`.recipe_parser` -- :class:`RecipeParser` (``HfArgumentParser`` with short aliases, the
  fields' checks as flag types, one-line errors), which generates the flag table.
* :mod:`.entry` -- :func:`recipe_main`, what the recipe scripts run: the flag check, then the run.
* :mod:`.run` -- checks made before a run (launcher, output folder, model folder, memory), the
  thread default and the results contract (``results.json``, ``cost_report.json``).
* :mod:`.nlp` -- the NLP recipes (``main(task, algorithm)``).

The vision recipes' command line is :mod:`lp_decentral_nlp.vision.recipe`; the cost command line
``python -m lp_decentral_nlp.cost``. Lazy (:mod:`lp_decentral_nlp.utils.lazy`): importing the
package imports neither torch nor transformers.
"""
from ..utils.lazy import lazy_namespace

# public name -> the submodule that defines it
_EXPORTS = {
    **dict.fromkeys(("ALIASES", "DefaultsHelpFormatter", "FlagType", "OneLineErrors", "OneLineParser", "ParsedFlags", "Range",
                     "add_default_malloc_flag", "add_device_flag", "add_threads_flag", "boolean", "check_flags", "flag_check_parser", "existing_path", "finite_float", "integer", "user_path",
                     "ranged"), ".flags"),
    "FLAG_TABLES": ".flag_table",
    "RecipeParser": ".recipe_parser",
    "recipe_main": ".entry",
    **dict.fromkeys(("NLPArguments", "build_nlp_parser", "load_classifier", "load_task_data", "load_tokenizer", "main",
                     "model_flag_problem", "prepare_nlp_run", "resolve_model", "run_nlp"), ".nlp"),
    **dict.fromkeys(("DEFAULT_MODEL", "RunArguments", "changed_settings", "config_differences", "finished_results",
                     "is_packaged_model", "load_data", "output_dir_problem", "output_in_data_problem", "recorded_path", "unrecorded_outputs_in", "output_file_problem", "packaged_model_path", "run_config", "saved_head_labels", "source_fingerprint", "source_fingerprints", "stop_on_interrupt",
                     "saved_thread_count", "threads_to_use", "train_and_report", "environment_problem", "error_summary",
                     "exit_with_error", "print_float32_notice", "print_notice", "remove_run_outputs",
                     "run_outputs_in", "set_threads", "strict_json", "write_json"), ".run"),
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_namespace(__name__, _EXPORTS, subpackages=("entry", "flag_table", "flags", "nlp",
                                                                        "recipe_parser", "run"))
