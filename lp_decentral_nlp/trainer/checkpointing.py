"""Checkpoints of a decentralized run: atomic directories, tensors in safetensors, everything else in JSON.

A checkpoint of a decentralized run is the directory ``output_dir/checkpoint-<step>/``. Its files
are written into ``output_dir/checkpoint-<step>.partial/`` (each one to a ``.tmp`` name, flushed,
fsynced and renamed), and the directory is renamed to ``checkpoint-<step>`` only once every file
is complete. A crash at any point therefore leaves every earlier checkpoint untouched and at most
a ``.partial`` directory, which :func:`list_checkpoints` ignores and the next checkpoint the
output folder gets removes. The manifest (:data:`MANIFEST`) is written last and lists the node files; a directory
is *complete* when the manifest and every file it lists are there.

Nested state (optimizer and scheduler state dicts, RNG states, ...) is split by
:func:`encode_state` into the tensors (stored in a ``.safetensors`` file under path-like keys) and
a JSON skeleton (stored in the same file's metadata), and put back together by
:func:`decode_state`: dicts with non-string keys, tuples and ``collections.Counter`` (e.g. a
``MultiStepLR``'s milestones) survive the round trip.
"""
from __future__ import annotations

import collections
import copy
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers import TrainerState
from transformers.trainer_callback import ExportableState
from transformers.utils import logging

from .. import __version__
from ..gossip import QuasiGlobalAdam
from ..gossip.factory import TOPOLOGIES, build_compressor, build_topology
from ..quant import QuantModule
from .arguments import DecentralizedTrainingArguments, unread_adam_settings
from .node_data import rows_digest

logger = logging.get_logger(__name__)

MANIFEST = "decentralized_state.json"
FORMAT = "lp_decentral_nlp.decentralized_checkpoint"
VERSION = 1
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
_UNFINISHED_DIR = re.compile(r"^checkpoint-\d+\.(partial|replaced)$")  # left by a crash in a save or a commit
_STATE_KEY = "state"  # safetensors metadata entry holding the JSON skeleton
_MANIFEST_KEYS = ("global_step", "data", "config", "logging", "files")


def checkpoint_dir(output_dir, step: int) -> Path:
    """``output_dir/checkpoint-<step>``."""
    return Path(output_dir) / f"checkpoint-{step}"


def staging_dir(output_dir, step: int) -> Path:
    """Where the files of ``checkpoint-<step>`` are written before the final rename."""
    return Path(output_dir) / f"checkpoint-{step}.partial"


def node_file(node: int) -> str:
    """File name of graph node ``node``'s state inside a checkpoint."""
    return f"node-{node}.safetensors"


# -- nested state <-> (JSON skeleton, flat tensors) ----------------------------------------------

def encode_state(obj, prefix: str = "") -> tuple[object, dict[str, torch.Tensor]]:
    """Split ``obj`` (nested dicts/lists/tuples/Counters of tensors and JSON scalars) into a JSON
    skeleton and ``{key: tensor}`` with CPU, contiguous tensors that share no memory (what
    safetensors needs). Raises TypeError naming the path of an unsupported value."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()

    def enc(value, path):
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            ptr = t.untyped_storage().data_ptr()
            if ptr in storages:  # tied or viewed tensors: safetensors refuses shared memory
                t = t.clone()
            storages.add(t.untyped_storage().data_ptr())
            tensors[path] = t
            return {"__tensor__": path}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, dict):
            counter = isinstance(value, collections.Counter)
            if not counter and all(isinstance(k, str) and not k.startswith("__") for k in value):
                return {k: enc(v, f"{path}/{k}") for k, v in value.items()}
            items = [[enc(k, f"{path}/{i}k"), enc(v, f"{path}/{i}")] for i, (k, v) in enumerate(value.items())]
            return {"__counter__" if counter else "__dict__": items}
        if isinstance(value, tuple):
            return {"__tuple__": [enc(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [enc(v, f"{path}/{i}") for i, v in enumerate(value)]
        raise TypeError(f"cannot checkpoint {path or 'the state'}: unsupported type {type(value).__name__}")

    return enc(obj, prefix), tensors


def decode_state(skeleton, tensors: dict[str, torch.Tensor]):
    """Inverse of :func:`encode_state`."""
    if isinstance(skeleton, list):
        return [decode_state(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if "__tensor__" in skeleton:
        return tensors[skeleton["__tensor__"]]
    if "__tuple__" in skeleton:
        return tuple(decode_state(v, tensors) for v in skeleton["__tuple__"])
    if "__counter__" in skeleton:
        return collections.Counter({decode_state(k, tensors): decode_state(v, tensors) for k, v in skeleton["__counter__"]})
    if "__dict__" in skeleton:
        return {_hashable(decode_state(k, tensors)): decode_state(v, tensors) for k, v in skeleton["__dict__"]}
    return {k: decode_state(v, tensors) for k, v in skeleton.items()}


def _hashable(key):
    return tuple(key) if isinstance(key, list) else key


# -- files -----------------------------------------------------------------------------------

def save_state_file(path, obj) -> None:
    """Write nested state ``obj`` to one ``.safetensors`` file, atomically (tmp file, fsync, rename)."""
    skeleton, tensors = encode_state(obj)
    _atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={_STATE_KEY: json.dumps(skeleton)}))


def load_state_file(path):
    """Read what :func:`save_state_file` wrote (tensors on the CPU, mapped from the file: a
    tensor kept beyond the load keeps the file's disk; ``copy.deepcopy`` copies it).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: naming ``path``: not a safetensors file (truncated, corrupted), no state
            skeleton, or a skeleton that does not match its tensors.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: checkpoint state file not found")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, RuntimeError, ValueError) as err:
        raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupted): {err}") from None
    if _STATE_KEY not in metadata:
        raise ValueError(f"{path} is not a checkpoint state file (no {_STATE_KEY!r} metadata)")
    try:
        return decode_state(json.loads(metadata[_STATE_KEY]), tensors)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path}: its state skeleton is corrupted ({type(err).__name__}: {err})") from None


def write_json(path, obj) -> None:
    """Write ``obj`` as JSON atomically (tmp file, fsync, rename)."""
    _atomic_write(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2)))


def _atomic_write(path, write) -> None:
    """``write(tmp)`` to a sibling tmp file, fsync it, then rename it over `path`."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    _fsync_file(tmp)
    os.replace(tmp, path)


def _fsync_file(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path) -> None:
    try:
        _fsync_file(path)
    except OSError:  # some filesystems cannot fsync a directory; the renames are still atomic
        pass


# -- directories -----------------------------------------------------------------------------

def prepare_staging(output_dir, step: int) -> Path:
    """An empty ``checkpoint-<step>.partial`` (a stale one from a crash is removed first)."""
    staging = staging_dir(output_dir, step)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def commit(output_dir, step: int) -> Path:
    """Rename the complete staging directory to ``checkpoint-<step>`` (replacing an older one at
    the same step), remove what a crashed save or commit left in ``output_dir`` (other
    ``checkpoint-<n>.partial`` / ``.replaced`` directories: a run writes one checkpoint at a time)
    and return its path."""
    staging, final = staging_dir(output_dir, step), checkpoint_dir(output_dir, step)
    if not is_complete(staging):
        raise RuntimeError(f"{staging} is not complete: refusing to publish it as {final.name}")
    _fsync_dir(staging)
    if final.exists():
        old = final.with_name(final.name + ".replaced")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old)
    else:
        os.replace(staging, final)
    _fsync_dir(final.parent)
    for stale in final.parent.iterdir():
        if _UNFINISHED_DIR.match(stale.name) and stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale)
    return final


def read_manifest(path, required=("files",)) -> dict:
    """The manifest of checkpoint directory ``path``, which must hold the ``required`` fields
    (:data:`_MANIFEST_KEYS`: all that resuming reads).

    Raises:
        ValueError: naming the manifest: missing, not JSON (truncated, corrupted), another format
            or format version (written by another version of this package), or lacking a field.
    """
    path = Path(path)
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} is not a complete checkpoint: {MANIFEST} is missing") from None
    except (ValueError, OSError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{file} is not valid JSON (truncated or corrupted): {err}") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{file} is not a {FORMAT} manifest (a JSON {type(manifest).__name__}, not an object)")
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        written_by = manifest.get("package_version")
        raise ValueError(f"{file} is not a version-{VERSION} {FORMAT} manifest "
                         f"(format={manifest.get('format')!r}, version={manifest.get('version')!r}"
                         + (f", written by lp_decentral_nlp {written_by}" if written_by else "")
                         + f"; this is lp_decentral_nlp {__version__})")
    missing = [key for key in required if key not in manifest]
    if missing:
        raise ValueError(f"{file} lacks {', '.join(missing)} (truncated or edited)")
    return manifest


def missing_files(path) -> list[str]:
    """Files the manifest of ``path`` lists that are not there (the manifest itself if it is
    missing); ValueError naming the manifest when it is there but unreadable."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        return [MANIFEST]
    return [name for name in read_manifest(path)["files"] if not (path / name).is_file()]


def is_complete(path) -> bool:
    """Whether ``path`` is a checkpoint directory with a readable manifest and every file it lists."""
    try:
        return Path(path).is_dir() and not missing_files(path)
    except ValueError:
        return False


def list_checkpoints(output_dir) -> list[tuple[int, Path]]:
    """Complete ``checkpoint-<step>`` directories in ``output_dir``, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _CHECKPOINT_DIR.match(p.name))]
    return sorted((step, p) for step, p in found if is_complete(p))


def resolve_checkpoint(path) -> Path:
    """``path`` itself if it is a complete checkpoint, else the latest complete checkpoint in it.

    Raises:
        ValueError: ``path`` does not exist, is an incomplete checkpoint (the message lists the
            missing files), or holds no complete checkpoint.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{str(path)!r} does not exist")
    if not path.is_dir():
        raise ValueError(f"{path} is a file, not a checkpoint folder")
    if (path / MANIFEST).exists() or _CHECKPOINT_DIR.match(path.name):
        missing = missing_files(path)
        if missing:
            raise ValueError(f"{path} is incomplete, it lacks {', '.join(missing)}")
        return path
    found = list_checkpoints(path)
    if not found:
        # say why the newest checkpoint folder there is not complete (a damaged manifest, missing files)
        candidates = sorted((int(m.group(1)), p) for p in path.iterdir() if (m := _CHECKPOINT_DIR.match(p.name)))
        why = ""
        if candidates:
            newest = candidates[-1][1]
            try:
                why = f" ({newest.name} lacks {', '.join(missing_files(newest))})"
            except ValueError as err:
                why = f" ({err})"
        raise ValueError(f"no complete checkpoint-<step> directory in {path}{why}")
    return found[-1][1]


def rotate(output_dir, keep: int, best=None, keep_newest: bool = True) -> list[Path]:
    """Delete the oldest complete checkpoints until ``keep`` are left, as `Trainer`'s
    ``rotate_checkpoints``: never ``best`` (the best model's checkpoint) nor, with
    ``keep_newest``, the newest one (what an interrupted run resumes from), so ``keep=1`` with a
    best checkpoint older than the newest leaves both. ``keep_newest=False`` is the end of a
    training run with ``save_total_limit=1``: only ``best`` stays. Returns the deleted paths."""
    found = [p for _, p in list_checkpoints(output_dir)]
    protected = ({found[-1]} if keep_newest and found else set()) | ({Path(best)} & set(found) if best else set())
    excess = len(found) - max(keep, len(protected)) if keep > 0 else 0
    doomed = [p for p in found if p not in protected][:max(excess, 0)]
    for p in doomed:
        shutil.rmtree(p)
    return doomed


# -- the trainer's decentralized state --------------------------------------------------------

def _state_dict_mismatch(expected: dict, saved, shown: int = 3) -> str | None:
    """How a saved model state dict differs from the model's (`expected`) in keys and tensor shapes,
    in one line with the first `shown` names of each kind; None when they fit."""
    if not isinstance(saved, dict):
        return f"a {type(saved).__name__}, not a state dict"
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    reshaped = [f"{k} {tuple(saved[k].shape)} saved, {tuple(v.shape)} here" for k, v in expected.items()
                if k in saved and hasattr(saved[k], "shape") and tuple(saved[k].shape) != tuple(v.shape)]
    kinds = (("missing", missing), ("unexpected", unexpected), ("of another shape", reshaped))
    parts = [f"{len(names)} key{'s' * (len(names) > 1)} {what}: {', '.join(names[:shown])}"
             f"{', ...' if len(names) > shown else ''}" for what, names in kinds if names]
    return "; ".join(parts) or None


def _one_line(err: BaseException, limit: int = 400) -> str:
    """`err`'s message on one line (torch's load_state_dict errors span several), at most `limit` characters."""
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _manifest_config(path) -> dict | None:
    """The settings a checkpoint's manifest records (:func:`resume_config` and the trainer's
    additions), or None where it cannot be read."""
    try:
        return read_manifest(path, required=("config",))["config"]
    except ValueError:
        return None


class CheckpointError(ValueError):
    """The checkpoint given to resume from cannot continue this run (damaged, incomplete, or
    written by another model or other settings); raised by ``train()`` before any training step."""


def resume_config(args: DecentralizedTrainingArguments, optimizer_cls_and_kwargs=None) -> dict:
    """The arguments a resumed run must share with its checkpoint: those that shape the saved
    state, the optimizer settings the restored optimizer and LR-schedule states carry (a
    different ``learning_rate`` would otherwise be silently replaced by the saved one; with the
    trainer's ``optimizer_cls_and_kwargs``, that pair: :func:`optimizer_settings`), and those
    that shape every step after it (the schedule's type, arguments and warmup, gradient clipping,
    label smoothing, mixed precision: a different one made a run neither the interrupted one nor a
    fresh one)."""
    config = args.gossip_config
    graph = build_topology(config)
    return {"num_nodes": args.num_nodes, "algorithm": args.algorithm,
            # a file's graph by its matrices, whatever the file's name (it may have changed since the checkpoint)
            "topology": graph.name if config.topology in TOPOLOGIES else f"mixing matrices #{graph.fingerprint():x}",
            "compressor": repr(build_compressor(config)), "consensus_lr": args.gamma, "low_precision": args.low_precision,
            "qgm": args.qgm, "skew": args.skew, "seed": args.seed, "data_seed": args.data_seed,
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps, "shard_column": args.shard_column,
            "optim": str(getattr(args.optim, "value", args.optim)), "learning_rate": args.learning_rate,
            "weight_decay": args.weight_decay, "adam_beta1": args.adam_beta1, "adam_beta2": args.adam_beta2,
            "adam_epsilon": args.adam_epsilon,
            "lr_milestones": list(args.lr_milestones) if args.lr_milestones else None, "lr_decay": args.lr_decay,
            "lr_scheduler_type": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
            # as the manifest's JSON gives it back (tuples become lists)
            "lr_scheduler_kwargs": json.loads(json.dumps(args.lr_scheduler_kwargs or {}, default=str)),
            "warmup_steps": args.warmup_steps, "max_grad_norm": args.max_grad_norm,
            "label_smoothing_factor": args.label_smoothing_factor, "mixed_precision": args.mixed_precision,
            "optimizer": optimizer_settings(optimizer_cls_and_kwargs), "gossip_reference": args.gossip_reference}


def optimizer_settings(optimizer_cls_and_kwargs) -> dict | None:
    """The optimizer the trainer's ``optimizer_cls_and_kwargs`` builds, as a checkpoint's manifest
    records it: ``{"class": "module.QualifiedName", "kwargs": {...}}`` (the keyword arguments as
    JSON gives them back); None when the optimizer comes from the arguments (``optim``,
    ``learning_rate``, ...), which :func:`resume_config` compares field by field."""
    if optimizer_cls_and_kwargs is None:
        return None
    optimizer_cls, kwargs = optimizer_cls_and_kwargs
    return {"class": _qualified_name(optimizer_cls),
            # a value JSON cannot hold (a function, a generator) by its name: its repr may hold an address
            "kwargs": json.loads(json.dumps(dict(kwargs), default=lambda value: f"<{_qualified_name(value)}>"))}


def _qualified_name(obj) -> str:
    """``module.QualifiedName`` of a class or function, else of its type."""
    named = obj if hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(named, '__module__', '')}.{named.__qualname__}"


#: values of :func:`resume_config` keys for checkpoints written before the key existed
_RESUME_DEFAULTS = {"gradient_accumulation_steps": 1, "shard_column": None, "mixed_precision": "no", "data_seed": None,
                    "gossip_reference": "zero"}
#: :func:`resume_config` keys compared only when the checkpoint holds them (checkpoints written
#: before they were added restore those settings as saved, as they always did)
_RESUME_IF_SAVED = ("optim", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
                    "lr_milestones", "lr_decay", "train_rows", "lr_scheduler_type", "lr_scheduler_kwargs",
                    "warmup_steps", "max_grad_norm", "label_smoothing_factor", "quant_config", "optimizer",
                    "initial_model")


def quant_settings(model) -> dict | None:
    """What a resumed run's 8-bit layers must share with its checkpoint: their ``QuantConfig``
    fields but the kernel (a kernel computes the same products up to fp32 rounding), as the
    manifest's JSON gives them back; None for a model without 8-bit layers."""
    layer = next((m for m in model.modules() if isinstance(m, QuantModule)), None)
    if layer is None:
        return None
    return json.loads(json.dumps({k: v for k, v in layer.quant_config.to_dict().items() if k != "kernel"}))


def check_resumable(path, args: DecentralizedTrainingArguments, train_samples: int | None = None, *,
                    unresolved: tuple[str, ...] = (), train_rows: str | None = None, quant_config: dict | None = None,
                    optimizer_cls_and_kwargs=None, initial_model: str | None = None):
    """The checkpoint directory ``path`` resolves to (:func:`resolve_checkpoint`),
    after checking that it was written by a run with the same :func:`resume_config` (and, when
    given, the same number of training samples, the same training rows: ``train_rows``, their
    :func:`~.node_data.rows_digest`, and the same 8-bit settings: ``quant_config``,
    :func:`quant_settings`), the same initial model (``initial_model``: the gossip engine's
    ``reference_fingerprint`` under ``gossip_reference="initial"``), and the same
    ``optimizer_cls_and_kwargs`` (the trainer's, or None). ValueError listing every argument that
    differs.
    ``unresolved``: :func:`resume_config` keys not compared, because ``args`` holds a placeholder the
    caller resolves later (``train()`` compares every key)."""
    try:
        path = resolve_checkpoint(path)
        manifest = read_manifest(path, required=_MANIFEST_KEYS)
    except ValueError as err:
        raise ValueError(f"resume_from_checkpoint: {err}") from None
    if manifest.get("model_only"):
        raise ValueError(f"resume_from_checkpoint: cannot resume from {path}: it was written with save_only_model=True "
                         "and holds the nodes' models only (no optimizer, LR schedule, RNG or gossip state); its "
                         "averaged model loads with from_pretrained")
    saved = manifest["config"]
    now = {key: value for key, value in resume_config(args, optimizer_cls_and_kwargs).items() if key not in unresolved}
    if train_samples is not None:
        now["train_samples"] = train_samples
    if train_rows is not None:
        now["train_rows"] = train_rows
    if quant_config is not None:
        now["quant_config"] = quant_config
    if initial_model is not None:
        now["initial_model"] = initial_model
    saved = {**_RESUME_DEFAULTS, **saved}
    if "bf16" in saved:  # written before fp16: a flag for bf16 autocast
        saved["mixed_precision"] = "bf16" if saved.pop("bf16") else "no"
    def differs(key, value) -> str:
        if key == "train_rows":
            return "other training rows (another data file, tokenizer or max length)"
        if key == "initial_model":
            return ("another initial model (gossip_reference='initial' gossips the offsets from it: build the trainer "
                    "from the model the run started from, not from a checkpoint's)")
        if key == "topology" and str(value).startswith("mixing matrices #"):
            return (f"another graph: {saved.get(key)!r} (this run's file {args.topology} holds {value!r}; a file is "
                    "recorded by its matrices)")
        if key == "compressor" and str(saved.get(key)).startswith("QSGD(") and "bucket_size" not in saved[key]:
            return (f"compressor={saved[key]!r}, one norm per tensor (this version rounds QSGD in buckets of 1024 "
                    "entries, with another default consensus step: no argument continues that run; start afresh)")
        if key == "mixed_precision":  # set by the fields or by the launcher, whose command may be all that changed
            return (f"mixed_precision={saved.get(key)!r} (this run: {value!r}; bf16=True / fp16=True, or accelerate "
                    "launch --mixed_precision, sets it)")
        if key == "consensus_lr" and args.consensus_lr is None:  # the default follows other settings
            return (f"consensus_lr={saved.get(key)!r} (this run's default: {value!r}; it follows the compression, "
                    f"graph and drop_prob: pass consensus_lr={saved.get(key)!r} to resume under other faults)")
        return f"{key}={saved.get(key)!r} (this run: {value!r})"

    unread = unread_adam_settings(vars(args))  # e.g. adam_beta2 of an SGD run: saved as given, never used
    diffs = [differs(key, value) for key, value in now.items()
             if saved.get(key) != value and (key in saved or key not in _RESUME_IF_SAVED) and key not in unread]
    if diffs:
        raise ValueError(f"resume_from_checkpoint: cannot resume from {path}: it was written with {', '.join(diffs)}; "
                         "resume with the arguments of the interrupted run")
    return path


class CheckpointMixin:
    """`DecentralizedTrainer`'s save and load of the whole decentralized state (every node)."""

    def _resume_hint(self) -> str:
        found = list_checkpoints(self.args.output_dir) if self.args.output_dir else []
        if not found:
            return ("No checkpoint was written yet (save_strategy='steps' with save_steps=N writes them; in a recipe, "
                    "--save-steps N)")
        return (f"Resume from the last checkpoint with resume_from_checkpoint={str(found[-1][1])!r} (in a recipe, "
                f"--resume-from-checkpoint {found[-1][1]})")

    def _new_trainer_state(self) -> TrainerState:
        """A fresh `TrainerState` holding, as Trainer's does, the state of every callback that can
        export one (``ExportableState``: ``EarlyStoppingCallback``'s patience counter, the
        `TrainerControl`), which checkpoints save and ``restore_callback_states_from_checkpoint``
        restores."""
        callbacks = self.callback_handler.callbacks + [self.control]
        return TrainerState(stateful_callbacks=[cb for cb in callbacks if isinstance(cb, ExportableState)])

    def _save_checkpoint(self, model, trial):
        """Write ``output_dir/checkpoint-<step>/`` atomically (the functions above).

        Files: ``node-<i>.safetensors`` per node (:meth:`_node_state`; its model alone with
        ``save_only_model``, which makes the checkpoint one to load, not to resume), the averaged model in
        Hugging Face format (``config.json``, ``model.safetensors``, tokenizer,
        ``training_args.bin``), ``trainer_state.json`` (`TrainerState`: log history, callback
        states...) and the manifest ``decentralized_state.json`` (step, position in the data, run
        configuration, logging accumulators, list of files). In the distributed backend every
        rank writes its own node file into the shared staging directory (``output_dir`` must be
        visible to all ranks), the ranks report success to each other (an all-gather), and rank 0
        writes the rest and renames the directory.
        """
        step = self.state.global_step
        out = self.args.output_dir
        self._refresh_average_model()  # a collective in the distributed backend: every rank joins
        self.store_flos()  # the counts saved are those up to this step
        if self.args.include_num_input_tokens_seen != "no":
            self._collect_input_tokens()
        main = self.state.is_world_process_zero
        if main:
            prepare_staging(out, step)
        self.node_group.barrier()
        staging = staging_dir(out, step)
        error = None
        try:
            for k, i in enumerate(self.node_ids):
                state = ({"node": i, "model": self.nodes[k].state_dict()} if self.args.save_only_model
                         else self._node_state(k))
                save_state_file(staging / node_file(i), state)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
        failed = [(r, e) for r, e in enumerate(self.node_group.gather_objects(error)) if e]
        if failed:
            rank, msg = failed[0]
            raise RuntimeError(f"checkpoint-{step}: rank {rank} could not write its node file ({msg}); "
                               "earlier checkpoints are untouched")
        if self.state.best_global_step == step:  # on every rank: each loads its nodes from it at the end
            self.state.best_model_checkpoint = str(checkpoint_dir(out, step))
        if main:
            self._write_model(staging)
            self.state.stateful_callbacks = self._new_trainer_state().stateful_callbacks  # their state now
            self.state.save_to_json(str(staging / "trainer_state.json"))
            epoch, done = self._data_position
            write_json(staging / MANIFEST, {
                "format": FORMAT, "version": VERSION, "package_version": __version__, "global_step": step,
                # batches_done: optimizer steps taken in the epoch (micro-batches / gradient_accumulation_steps)
                "data": {"epoch": epoch, "batches_done": done, "steps_per_epoch": self._steps_per_epoch},
                "config": self._resume_config(),
                "logging": {"last_logged": self._last_logged, "total_loss": self._total_loss,
                            "loss_steps": self._loss_steps},
                "backend": self.args.backend, "model_only": self.args.save_only_model,
                "files": [node_file(i) for i in range(self.args.num_nodes)] + ["trainer_state.json"],
            })
            commit(out, step)
            if self.args.save_total_limit:
                rotate(out, self.args.save_total_limit, best=self.state.best_model_checkpoint)
            if self.args.push_to_hub:  # Trainer's upload of a checkpoint's model (all of it, per hub_strategy)
                self._push_from_checkpoint(str(checkpoint_dir(out, step)))
        self.node_group.barrier()
        self._checkpoint_step = step

    def _checkpoint_and_stop(self) -> None:
        """SIGTERM under ``enable_jit_checkpoint``: a checkpoint at this step (unless the save
        steps just wrote it), then the end of training (``stopped_by_sigterm``). The process that
        writes the shared files says so (every process of a launch stops at this step)."""
        step = self.state.global_step
        if self._checkpoint_step != step:
            self._save_checkpoint(self.model, None)
        if self.state.is_world_process_zero and self.log_sigterm_stop:
            logger.warning(f"stopped at step {step} on SIGTERM; resume from "
                           f"{checkpoint_dir(self.args.output_dir, step)}")
        self.stopped_by_sigterm = True
        self.control.should_training_stop = True

    def _node_state(self, k: int) -> dict:
        """Everything local node ``k`` holds: model state dict (parameters and buffers, the 8-bit
        activation ranges included), optimizer and LR scheduler state, its RNG stream, its gossip
        rows (push-sum weight, Choco copies / Deep-Squeeze error memory, labelled by node id), QGM
        state (SGD: the buffer ``m``, a list of tensors; Adam/AdamW: ``exp_avg``, ``exp_avg_sq`` and
        ``steps`` of :class:`~lp_decentral_nlp.gossip.QuasiGlobalAdam`), its float16 loss scaler's
        state (None without fp16), and counters (bytes sent, skipped steps, loss accumulated since
        the last log)."""
        i = self.node_ids[k]
        optimizer, scheduler = self.node_optimizers[k], self.node_schedulers[k]
        return {
            "node": i,
            "model": self.nodes[k].state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": self._rng.state_dict(i),
            "gossip": self.gossip.node_state_dict(i),
            "qgm": self._qgm_node_state(k),
            "scaler": self.node_scalers[k].state_dict() if self.node_scalers is not None else None,
            "counters": {"bytes_sent": int(self.bytes_sent[k]), "nonfinite_skips": int(self.nonfinite_skips[k]),
                         "overflow_skips": int(self.overflow_skips[k]), "lost_messages": int(self.lost_messages[k]),
                         "absent_steps": int(self.absent_steps[k]),
                         "loss_sum": self._loss_sum[k], "loss_count": int(self._loss_count[k]),
                         "grad_norm": self._grad_norm[k]},
        }

    def _qgm_node_state(self, k: int):
        """Local node ``k``'s QGM state for its node file (None without QGM)."""
        if self.qgm is None:
            return None
        if isinstance(self.qgm, QuasiGlobalAdam):
            return self.qgm.node_state_dict(k)
        return list(self.qgm.momentum[k])

    def _load_qgm_node_state(self, k: int, state) -> None:
        """Restore what :meth:`_qgm_node_state` gave into local node ``k``."""
        if isinstance(self.qgm, QuasiGlobalAdam):
            if not isinstance(state, dict):
                raise TypeError("it holds an SGD momentum buffer, this run uses QGM with Adam/AdamW")
            self.qgm.load_node_state_dict(k, state)
        else:
            if not isinstance(state, list):
                raise TypeError("it holds QGM Adam moments, this run uses QGM with SGD")
            torch._foreach_copy_(self.qgm.momentum[k], state)

    def _load_best_nodes(self) -> None:
        """``load_best_model_at_end``: every local node's weights from the best checkpoint, so the
        averaged model is the best one evaluated, and ``self.best_model_loaded`` says which
        (``{"step", "checkpoint", <metric_for_best_model>: value}``).

        A best evaluation on a step without a checkpoint (``save_steps`` a multiple of
        ``eval_steps``, ``eval_on_start``) cannot be loaded: the best evaluated checkpoint still on
        disk is (Trainer loads the last one saved at a running best, or none, and named the best
        score beside it), with a warning naming both; with none the model stays the last step's,
        with a warning."""
        state, metric = self.state, self.args.metric_for_best_model
        if state.best_global_step is None:  # no evaluation during training
            return
        best = f"{metric}={state.best_metric:g} at step {state.best_global_step}"
        remedy = "save_strategy='best' (or save_steps=eval_steps) saves every new best"
        path = state.best_model_checkpoint
        if path is not None and int(Path(path).name.rpartition("-")[2]) == state.best_global_step:
            step, value = state.best_global_step, state.best_metric
            logger.info(f"loading the best model from {path} ({metric}={value:g})")
        else:
            saved = self._best_evaluated_checkpoint(metric)
            if saved is None:
                logger.warning(f"load_best_model_at_end: no checkpoint holds an evaluation, the best ({best}) "
                               f"included: the model is the last step's; {remedy}")
                return
            step, path, value = saved
            logger.warning(f"load_best_model_at_end: the best evaluation ({best}) has no checkpoint: loading {path}, "
                           f"the best evaluated checkpoint ({metric}={value:g} at step {step}); {remedy}")
            state.best_model_checkpoint = str(path)  # the one save_total_limit=1 keeps at the end
        self.best_model_loaded = {"step": step, "checkpoint": str(path), metric: value}
        self._average_is_current = False
        for k, i in enumerate(self.node_ids):
            self.nodes[k].load_state_dict(load_state_file(Path(path) / node_file(i))["model"])

    def _best_evaluated_checkpoint(self, metric: str) -> tuple[int, Path, float] | None:
        """``(step, folder, value)`` of the complete checkpoint in ``output_dir`` whose step's
        evaluation (``state.log_history``) scored best on `metric` (``greater_is_better``), among
        those written with this run's settings (not one an earlier run left there), or None."""
        key = metric if metric.startswith("eval_") else f"eval_{metric}"
        evaluated = {entry["step"]: entry[key] for entry in self.state.log_history if key in entry and "step" in entry}
        ours = json.loads(json.dumps(self._resume_config()))  # as the manifest holds it
        scored = [(step, path, evaluated[step]) for step, path in list_checkpoints(self.args.output_dir)
                  if step in evaluated and _manifest_config(path) == ours]  # not one an earlier run left there
        if not scored:
            return None
        pick = max if self.args.greater_is_better else min
        return pick(scored, key=lambda candidate: candidate[2])

    def _keep_only_best_checkpoint(self) -> None:
        """End of training with ``save_total_limit=1`` and a best checkpoint: delete every other
        checkpoint, as `Trainer` does (during training the newest one is kept too, to resume
        from). Rank 0 deletes, after every rank has read the best one."""
        best = self.state.best_model_checkpoint
        if self.args.save_total_limit == 1 and best is not None:
            self.node_group.barrier()
            if self.state.is_world_process_zero:
                rotate(self.args.output_dir, 1, best=best, keep_newest=False)

    def _resume_config(self) -> dict:
        return {**resume_config(self.args, self.optimizer_cls_and_kwargs), "train_samples": len(self.train_dataset),
                "train_rows": rows_digest(self.train_dataset), "quant_config": quant_settings(self.nodes[0]),
                "initial_model": self.gossip.reference_fingerprint}

    def _load_checkpoint(self, path, steps_per_epoch: int, max_steps: int) -> tuple[int, int]:
        """Restore the state :meth:`_save_checkpoint` wrote; returns the data position ``(epoch,
        batches_done)``. Every process reads and checks its nodes' files before any process restores
        anything, and the checkpoint is only read (the user's model and files are not modified).
        :class:`CheckpointError` naming the file or argument when the checkpoint does not fit, on
        every process of the run when one process's part does not."""
        read = self._agreed(lambda: self._read_checkpoint(path, steps_per_epoch, max_steps))
        return self._agreed(lambda: self._restore_checkpoint(*read))

    def _agreed(self, step):
        """``step()``'s result once every process has run its own; :class:`CheckpointError` with
        the first process's ValueError on every process if one raised one."""
        try:
            result, error = step(), None
        except ValueError as err:
            result, error = None, str(err)
        errors = [e for e in self.node_group.gather_objects(error) if e]
        if errors:
            raise CheckpointError(errors[0])
        return result

    def _read_checkpoint(self, path, steps_per_epoch: int, max_steps: int) -> tuple:
        """``(path, manifest, trainer_state, {node id: state})`` of the checkpoint at `path`, read and
        checked against this run of `max_steps` steps (ValueError naming the file or argument)."""
        path = check_resumable(path, self.args, train_samples=len(self.train_dataset),
                               train_rows=rows_digest(self.train_dataset), quant_config=quant_settings(self.nodes[0]),
                               optimizer_cls_and_kwargs=self.optimizer_cls_and_kwargs,
                               initial_model=self.gossip.reference_fingerprint)
        manifest = read_manifest(path, required=_MANIFEST_KEYS)
        data = manifest["data"]
        if data["steps_per_epoch"] != steps_per_epoch:
            raise ValueError(f"cannot resume from {path}: it has {data['steps_per_epoch']} steps per epoch, this run "
                             f"{steps_per_epoch} (a different training set or batch size)")
        if manifest["global_step"] > max_steps:  # (Trainer trains nothing and reports the checkpoint's model)
            raise ValueError(f"cannot resume from {path}: it is at step {manifest['global_step']}, past this run's last "
                             f"step, {max_steps} (max_steps, num_train_epochs): train for more steps, or resume from "
                             "an earlier checkpoint")
        state_file = path / "trainer_state.json"
        try:
            trainer_state = TrainerState.load_from_json(str(state_file))
        except (ValueError, TypeError, OSError) as err:
            raise ValueError(f"{state_file} is not a readable TrainerState (truncated or corrupted): {err}") from None
        states = {i: load_state_file(path / node_file(i)) for i in self.node_ids}
        for i, state in states.items():
            missing = [key for key in ("model", "optimizer", "scheduler", "rng", "gossip", "qgm", "counters")
                       if not isinstance(state, dict) or key not in state]
            if missing:
                raise ValueError(f"{path / node_file(i)} lacks {', '.join(missing)}: not a node file of this trainer")
            if self.qgm is not None and state["qgm"] is None:
                raise ValueError(f"{path / node_file(i)} has no QGM buffer: the checkpoint was written without qgm")
            if self.node_scalers is not None and not isinstance(state.get("scaler"), dict):
                raise ValueError(f"{path / node_file(i)} has no loss scaler state: the checkpoint was written without "
                                 f"fp16")
        return path, manifest, trainer_state, states

    def _restore_checkpoint(self, path, manifest: dict, trainer_state: TrainerState, states: dict) -> tuple[int, int]:
        """Restore what :meth:`_read_checkpoint` read; returns the data position ``(epoch, batches_done)``."""
        data = manifest["data"]
        self._restore_nodes(path, states)
        step = manifest["global_step"]
        if self.gossip.num_steps != step:
            raise ValueError(f"{path}: gossip state is at step {self.gossip.num_steps}, the manifest at step {step}")
        self.state = trainer_state
        self._load_callback_state()  # Trainer's: the callbacks' states, if restore_callback_states_from_checkpoint
        self._last_logged = manifest["logging"]["last_logged"]
        self._total_loss = manifest["logging"]["total_loss"]
        # a checkpoint written before the count was kept counted every logged step
        self._loss_steps = manifest["logging"].get("loss_steps", self._last_logged)
        self._data_position = (data["epoch"], data["batches_done"])
        self.resumed_from = (str(path), step)
        logger.info(f"resumed from {path} at step {step} (epoch {data['epoch']}, batch {data['batches_done']})")
        return self._data_position

    def _restore_nodes(self, path, states: dict) -> None:
        """Load each local node's ``states[node_id]`` (read by :func:`load_state_file`) into its
        model, optimizer, scheduler, RNG stream, QGM buffer, counters and gossip rows; ValueError
        naming the node file whose part does not fit."""
        self._average_is_current = False
        parts = []
        for k, i in enumerate(self.node_ids):
            file, state = path / node_file(i), states[i]
            mismatch = _state_dict_mismatch(self.nodes[k].state_dict(), state["model"])
            if mismatch:
                raise ValueError(f"{file} does not fit this model ({mismatch}): it was written for another model")
            # an optimizer keeps the state tensors it is given, and those read map the node file: a copy,
            # or a checkpoint save_total_limit deletes after a resume holds its disk until the process ends
            # (the model, gossip and QGM parts are copied into their own tensors)
            steps = [("model", lambda: self.nodes[k].load_state_dict(state["model"])),
                     ("optimizer", lambda: self.node_optimizers[k].load_state_dict(copy.deepcopy(state["optimizer"]))),
                     ("scheduler", lambda: self.node_schedulers[k].load_state_dict(state["scheduler"])),
                     ("rng", lambda: self._rng.load_state_dict(i, state["rng"]))]
            if self.qgm is not None:
                steps.append(("qgm", lambda: self._load_qgm_node_state(k, state["qgm"])))
            if self.node_scalers is not None:
                steps.append(("scaler", lambda: self.node_scalers[k].load_state_dict(state["scaler"])))
            for part, load in steps:  # each called at once, in this iteration
                try:
                    load()
                except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as err:
                    raise ValueError(f"{file} does not fit this model: {part}: {_one_line(err)}") from None
            counters = state["counters"]
            self.bytes_sent[k] = counters["bytes_sent"]
            self.nonfinite_skips[k] = counters["nonfinite_skips"]
            self.overflow_skips[k] = counters.get("overflow_skips", 0)  # older checkpoints have none of these
            self.lost_messages[k] = counters.get("lost_messages", 0)
            self.absent_steps[k] = counters.get("absent_steps", 0)
            self._loss_sum[k] = counters["loss_sum"]
            self._loss_count[k] = counters["loss_count"]
            self._grad_norm[k] = counters.get("grad_norm", torch.nan)  # older checkpoints have none
            parts.append(state["gossip"])
        try:
            self.gossip.load_node_state_dicts(parts)
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as err:
            raise ValueError(f"{path}: the gossip state of {', '.join(node_file(i) for i in self.node_ids)} does not "
                             f"fit this run: {_one_line(err)}") from None
