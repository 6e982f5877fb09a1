"""The vision recipes' command line (SPEC section 8): decentralized training of a CNN from scratch.

``main(algorithm="choco")`` parses the flags shared with the NLP recipes
(:class:`lp_decentral_nlp.commands.RecipeParser`: every ``TrainingArguments`` flag and the short
aliases) plus :class:`VisionArguments` (``--dataset --data-dir --image-size --augment --arch --norm
--groups``) and ``--lr-milestones``, trains with
:class:`~lp_decentral_nlp.trainer.DecentralizedTrainer` (SGD, Nesterov momentum 0.9, weight
decay, LR x0.1 at each milestone epoch) and writes, under ``--output-dir``, the files of the NLP
recipes: ``results.json`` (same contract, cost report written at the start), ``metrics.csv`` and
``model/`` (the averaged model, :meth:`ImageClassifier.save_pretrained`: ``model.safetensors`` +
``vision_config.json``; reload with :meth:`ImageClassifier.from_pretrained`).

``--norm auto`` (the default) is the paper's pairing (SPEC 5): Range EvoNorm for 8-bit training,
EvoNorm-S0 with ``--full-precision``; any norm of :data:`~lp_decentral_nlp.vision.NORMS` can be
asked for with either precision (the 8-bit surgery quantizes EvoNorm-S0, Range EvoNorm and Range
BatchNorm; BatchNorm and GroupNorm stay fp32).
"""
from __future__ import annotations

import pathlib
import time
from dataclasses import dataclass, field

from ..checks import check_fields, checked_existing_path
from ..utils.fields_doc import document_fields
from ..commands.recipe_parser import RecipeParser
from ..commands.run import (RECIPE_REFUSALS, RECIPE_VALUE_CHECKS, RunArguments, check_memory, check_processes_agree,
                            check_training_rows, derive_run_values, exit_with_error, load_data, print_summary, run_checks,
                            set_process_output, set_run_help, set_threads, train_and_report)
from .models import ARCHS, NORMS, build_vision_model, image_size_problem

__all__ = ["VisionArguments", "build_vision_parser", "parse_vision_args", "run_vision", "main", "DEFAULT_NORMS",
           "SGD_OPTIM_ARGS"]

# SPEC 5: Range EvoNorm is the norm of 8-bit training, EvoNorm-S0 the one of fp32 training.
DEFAULT_NORMS = {"int8": "range_evonorm", "fp32": "evonorm"}
# SPEC 8: SGD with Nesterov momentum 0.9 (transformers' "sgd" optimizer reads these optim_args; the
# recipes set them for --optim sgd when --optim_args is not given: another optimizer reads none of them).
SGD_OPTIM_ARGS = "momentum=0.9,nesterov=True"
# SPEC 8: LR x0.1 at epochs 100 and 150 of 200, i.e. at these fractions of the run by default.
DEFAULT_MILESTONE_FRACTIONS = (0.5, 0.75)
# SPEC 8 (vision): SGD, Nesterov momentum 0.9, lr 0.1, weight decay 1e-4, multi-step schedule.
VISION_DEFAULTS = dict(learning_rate=0.1, weight_decay=1e-4, optim="sgd", optim_args=None,
                       lr_scheduler_type="constant", remove_unused_columns=False,  # the transform needs 'image'
                       per_device_train_batch_size=32, per_device_eval_batch_size=32, num_train_epochs=5.0,
                       logging_steps=None, save_strategy="no", save_steps=None, output_dir=None, seed=0)


@document_fields("each one a recipe flag: --help")
@dataclass
class VisionArguments(RunArguments):
    """The vision recipes' own options; ``None`` ones are resolved from the dataset and precision
    (:func:`parse_vision_args`)."""

    dataset: str = field(default="digits", metadata={
        "help": "Image dataset (digits: scikit-learn's bundled 8x8 digits, offline; cifar10, cifar100, imagenette "
                "from the hub or --data-dir; folder: your own images in --data-dir, any number of classes, with the "
                "image size and normalisation measured on them)"})
    data_dir: str | None = field(default=None, metadata={
        "help": "Local images (save_to_disk folder, or image folder tree train/<class>/<image> and test/ or val/): "
                "a copy of the named dataset, or with --dataset folder your own; not for digits"})
    image_size: int | None = field(default=None, metadata={
        "help": "Side of the square input in pixels (default: the dataset's, 8 for digits, 32 for CIFAR; with "
                "--dataset folder the median shorter side of the training images, at most 224)"})
    augment: bool | None = field(default=None, metadata={
        "help": "Random crop + horizontal flip of training images (default: on, off for digits, whose classes are "
                "not mirror-symmetric); --augment false turns it off"})
    arch: str = field(default="resnet20", metadata={"help": f"Network, one of {tuple(ARCHS)}"})
    norm: str = field(default="auto", metadata={
        "help": f"Normalisation, one of {('auto',) + NORMS}; auto = range_evonorm for 8-bit, evonorm with "
                "--full-precision (SPEC 5); batchnorm and groupnorm stay float32 in an 8-bit run"})
    groups: int = field(default=2, metadata={"help": "Groups of groupnorm/evonorm/range_evonorm"})
    num_classes: int | None = field(default=None, init=False)

    def __post_init__(self):
        from .data import FOLDER, VISION_DATASETS, vision_dataset_spec

        super().__post_init__()
        for name, allowed in (("dataset", (*VISION_DATASETS, FOLDER)), ("arch", tuple(ARCHS)),
                              ("norm", ("auto",) + NORMS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        # the user's own images: the class count comes from them (run_vision)
        self.num_classes = None if self.dataset == FOLDER else vision_dataset_spec(self.dataset).num_classes
        if self.dataset == FOLDER and self.data_dir is None:
            raise ValueError("data_dir: --dataset folder trains your own images: give their folder with --data-dir")
        if self.data_dir is not None and self.dataset == "digits":
            raise ValueError("data_dir: digits is bundled with scikit-learn and takes no data_dir (your own "
                             "images: add --dataset folder)")
        self.data_dir = checked_existing_path("data_dir", self.data_dir)
        check_fields(self, ("image_size", "groups"))


def _derive(values: dict) -> None:
    """Resolve ``--norm auto``, ``--image-size``, ``--augment``, ``--lr-milestones`` and SGD's
    ``--optim_args`` (SPEC 5, 8)."""
    from .data import NO_AUGMENT_DATASETS, VISION_DATASETS, vision_dataset_spec

    if values["optim_args"] is None and str(values["optim"]) == "sgd" and not values["qgm"]:  # QGM is the momentum
        values["optim_args"] = SGD_OPTIM_ARGS
    if values["norm"] == "auto":
        values["norm"] = DEFAULT_NORMS["int8" if values["low_precision"] else "fp32"]
    if values["dataset"] in VISION_DATASETS:
        spec = vision_dataset_spec(values["dataset"])
        values["image_size"] = values["image_size"] or spec.image_size
    if values["augment"] is None:
        values["augment"] = values["dataset"] not in NO_AUGMENT_DATASETS
    # the multi-step schedule by default (in epochs of --epochs here; of a --max_steps run once the trainer
    # knows its steps per epoch, _milestones_of_the_run); another --lr_scheduler_type is the schedule asked for
    default = values["lr_milestones"] is None and str(values["lr_scheduler_type"]) == "constant"
    values["lr_milestone_fractions"] = list(DEFAULT_MILESTONE_FRACTIONS) if default else None
    if default:
        values["lr_milestones"] = [f * values["num_train_epochs"] for f in DEFAULT_MILESTONE_FRACTIONS]
    elif values["lr_milestones"] == []:  # the flag alone: a constant learning rate
        values["lr_milestones"] = None
    derive_run_values(values, f"{values['dataset']}_{values['arch']}_{values['norm']}_{values['algorithm']}"
                              f"_skew{values['skew']}_comp{values['compression']}")


def _milestones_of_the_run(values: dict, training):
    """``before_train`` of :func:`~lp_decentral_nlp.commands.train_and_report`: the default milestones
    of a ``--max_steps`` run at :data:`DEFAULT_MILESTONE_FRACTIONS` of its steps, not of ``--epochs``
    (which ``--max_steps`` overrides), in the epochs of the trainer's shards."""
    def resolve(trainer) -> None:
        if values["lr_milestone_fractions"] and training.max_steps > 0:
            epochs = training.max_steps / trainer.steps_per_epoch()
            values["lr_milestones"] = training.lr_milestones = [f * epochs for f in values["lr_milestone_fractions"]]
    return resolve


def _image_size_problem(net, recipe, flag: str, origin: str | None = None) -> str | None:
    """Why ``recipe.image_size`` is too small for ``net``, with where the size came from when the
    flag did not give it (``origin``) and the flag that fixes it, else None."""
    problem = image_size_problem(net, recipe.arch, recipe.image_size)
    return problem and f"{problem}{f', {origin}' if origin else ''} (pass {flag} {net.min_size})"


def _check_network(parser, parsed) -> None:
    """Groups that do not divide the channels, or an input too small for the network, exit like a bad flag."""
    recipe = parsed.recipe
    try:  # --dataset folder: the class count comes with the data; it does not change the checks
        net = build_vision_model(recipe.arch, recipe.num_classes or 2, recipe.norm, recipe.groups)
    except ValueError as err:
        parser.error(f"argument --groups/--norm: {err}")
    if recipe.image_size is not None:  # --dataset folder without --image-size: checked once measured
        flag = parser.flag_of("image_size")
        problem = _image_size_problem(net, recipe, flag, None if parser.flag_given("image_size") else
                                      f"the size of the {recipe.dataset} images")
        if problem:
            parser.error(f"argument {flag}: {problem}")


def _check_packages(parser, parsed) -> None:
    """Without the ``[vision]`` extra the run stopped with an import traceback when it loaded the
    data: one line naming the pip command instead, before anything loads."""
    from .data import missing_vision_packages

    problem = missing_vision_packages(parsed.recipe.dataset)
    if problem:
        parser.error(problem)


def _check_columns(parser, parsed) -> None:
    """``--remove_unused_columns true`` would drop the ``image`` column the transform reads (the
    run failed at its first batch with a KeyError): refused like a bad flag."""
    if parsed.training.remove_unused_columns:
        parser.error(f"argument {parser.flag_of('remove_unused_columns')}: the image transform reads each sample's "
                     "'image' column, which the network's forward does not take: leave it False")


def build_vision_parser(algorithm: str, **kwargs) -> RecipeParser:
    """The vision recipes' parser (``parse()`` builds and checks everything); bad flags exit with
    one line on stderr (status 2)."""
    from ..trainer import DecentralizedTrainingArguments

    kwargs.setdefault("description", f"Decentralized {algorithm} training of a CNN (SPEC 8 optimizer; defaults "
                                     "sized for a CPU run on digits).")
    parser = RecipeParser(DecentralizedTrainingArguments, VisionArguments, defaults=VISION_DEFAULTS,
                          fixed={"algorithm": algorithm}, refused=RECIPE_REFUSALS,
                          derive=_derive, value_checks=RECIPE_VALUE_CHECKS,
                          checks=(run_checks, _check_packages, _check_network, _check_columns), **kwargs)
    set_run_help(parser, "<dataset>_<arch>_<norm>_<algorithm>_skew<skew>_comp<compression>", row_subsets=False)
    fractions = " and ".join(f"{f:.0%}%" for f in DEFAULT_MILESTONE_FRACTIONS)  # help text is %-formatted
    parser.set_help("lr_milestones", "Epochs at which the learning rate is multiplied by --lr_decay (SPEC 8); the "
                    f"flag alone: a constant LR (default: at {fractions} of the run, of --epochs or of --max_steps "
                    "when given, with --lr_scheduler_type constant)")
    parser.set_help("optim_args", f"Keyword arguments of the optimizer, 'name=value,...' (default: {SGD_OPTIM_ARGS} "
                                  "with --optim sgd, as SPEC 8 trains; none with --qgm, whose quasi-global momentum "
                                  "replaces SGD's)")
    return parser


def parse_vision_args(algorithm: str, argv: list[str] | None = None):
    """Parse and check the flags (:meth:`RecipeParser.parse`: ``.training``, ``.recipe``, ``.values``);
    ``--norm auto``, ``--image-size``, ``--augment`` and ``--lr-milestones`` come resolved."""
    return build_vision_parser(algorithm).parse(argv)


def run_vision(parsed, prog: str = "", on_interrupt: str | None = None) -> dict:
    """Train, evaluate and save one vision run from :func:`parse_vision_args`; returns the results.
    `on_interrupt`: what to do after Ctrl-C in training (``commands.train_and_report``)."""
    from transformers import set_seed

    from .classifier import ImageClassifier
    from .data import (FOLDER, folder_spec, load_vision_dataset, vision_dataset_spec, vision_preprocessing,
                       with_vision_transforms)

    training, recipe = parsed.training, parsed.recipe
    start = time.time()
    parsed.values["threads"] = set_threads(recipe)  # results.json records the count it ran with
    set_process_output(training)
    check_processes_agree(parsed, prog)
    raw = load_data(lambda: load_vision_dataset(recipe.dataset, data_dir=recipe.data_dir, seed=training.data_order_seed),
                    recipe.dataset, recipe.data_dir, prog, from_hub=recipe.dataset != "digits")  # digits: bundled
    check_training_rows(prog, training, len(raw["train"]), recipe.data_dir, recipe.dataset)
    # the user's images (--dataset folder) bring their classes, size and normalisation
    spec = folder_spec(raw, recipe.image_size) if recipe.dataset == FOLDER else vision_dataset_spec(recipe.dataset)
    size_measured = recipe.dataset == FOLDER and recipe.image_size is None
    recipe.num_classes, recipe.image_size = spec.num_classes, recipe.image_size or spec.image_size
    data = with_vision_transforms(raw, spec, recipe.image_size, augment=recipe.augment)
    # how to feed the model, saved with it (and, for the user's images, recorded in results.json)
    preprocessing = vision_preprocessing(raw, spec, recipe.image_size)
    if recipe.dataset == FOLDER:
        parsed.values.update(num_classes=spec.num_classes, image_size=recipe.image_size,
                             classes=preprocessing["labels"], mean=preprocessing["mean"], std=preprocessing["std"])
    set_seed(training.seed)
    model = ImageClassifier(recipe.arch, recipe.num_classes, recipe.norm, recipe.groups, preprocessing)
    problem = _image_size_problem(model.net, recipe, parsed.flags["image_size"],
                                  "the median shorter side of the training images" if size_measured else None)
    if problem:  # --dataset folder: the measured size (a named dataset's was checked with the flags)
        exit_with_error(prog, problem, parsed.flags["image_size"])
    model_used = f"{recipe.arch} ({recipe.norm}, {recipe.num_classes} classes, random init)"
    input_shape = (3, recipe.image_size, recipe.image_size)
    check_memory(model, training, input_shape, prog, parsed.flags["image_size"])
    # the card names the user's images by their folder
    dataset = pathlib.Path(recipe.data_dir).name if recipe.dataset == FOLDER else recipe.dataset
    return train_and_report(parsed, model, data, model_used, input_shape, start, prog,
                            before_train=_milestones_of_the_run(parsed.values, training), on_interrupt=on_interrupt,
                            card={"dataset": dataset, "tags": ["image-classification"]})


def main(algorithm: str, argv: list[str] | None = None, on_interrupt: str | None = None) -> dict:
    """Entry point of the vision recipes (`on_interrupt`: :func:`run_vision`'s)."""
    parser = build_vision_parser(algorithm)
    results = run_vision(parser.parse(argv), parser.prog, on_interrupt)
    print_summary(results)
    return results
