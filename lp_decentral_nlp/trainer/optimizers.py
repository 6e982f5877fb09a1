"""Each node's optimizer and LR schedule, and quasi-global momentum over the local nodes (SPEC 2 QGM).

The optimizers come from `transformers.Trainer`'s own factories (``optim``, ``learning_rate``,
``weight_decay``, ``lr_scheduler_type``... per node); ``lr_milestones`` gives the paper's
multi-step schedule. With ``qgm`` the quasi-global buffer replaces the optimizer's momentum: SGD
through :class:`~lp_decentral_nlp.gossip.QuasiGlobalMomentum`, Adam/AdamW through
:class:`~lp_decentral_nlp.gossip.QuasiGlobalAdam`, which takes the local step itself.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
from transformers import Trainer
from transformers.utils import logging

from .. import gossip as gossip_lib
from .arguments import ADAM_SETTINGS, DecentralizedTrainingArguments, qgm_beta_problem
from .field_policy import field_default, is_default

logger = logging.get_logger(__name__)


def check_qgm_optimizer(args: DecentralizedTrainingArguments, model, optimizer_cls_and_kwargs=None) -> None:
    """Refuse, at construction, an optimizer that quasi-global momentum cannot serve (SPEC 2): QGM
    replaces the momentum of SGD or the first moment of Adam/AdamW (``torch.optim.SGD``,
    ``torch.optim.Adam`` and subclasses); ``qgm_beta`` is the SGD buffer's factor, so with Adam
    (whose first moment uses ``adam_beta1``) it must keep its default, and SGD's own momentum,
    Nesterov or dampening (``optim_args``), which QGM would drop, are refused."""
    if optimizer_cls_and_kwargs is not None:
        (optimizer_cls, kwargs), where = optimizer_cls_and_kwargs, "optimizer_cls_and_kwargs"
    else:
        optim = getattr(args.optim, "value", args.optim)
        (optimizer_cls, kwargs), where = Trainer.get_optimizer_cls_and_kwargs(args, model), f"optim={optim!r}"
    name = getattr(optimizer_cls, "__name__", type(optimizer_cls).__name__)
    if not isinstance(optimizer_cls, type) or not issubclass(optimizer_cls, (torch.optim.SGD, torch.optim.Adam)):
        raise ValueError(f"qgm=True needs an SGD or Adam/AdamW optimizer (QGM replaces its momentum), got {where} "
                         f"({name}): use optim='adamw_torch' or 'sgd', or qgm=False")
    own = {key: kwargs[key] for key in ("momentum", "nesterov", "dampening") if kwargs.get(key)}
    if issubclass(optimizer_cls, torch.optim.SGD) and own:  # QGM sets SGD's momentum to 0: these would be dropped
        source = "optim_args" if optimizer_cls_and_kwargs is None else "its keyword arguments"
        raise ValueError(f"qgm=True replaces SGD's momentum with the quasi-global one (qgm_beta={args.qgm_beta}), and "
                         f"{where} asks for {', '.join(f'{k}={v}' for k, v in own.items())}: drop "
                         f"{'them' if len(own) > 1 else 'it'} ({source}) and set qgm_beta for the momentum")
    problem = qgm_beta_problem(args, optimizer_cls)
    if problem:
        raise ValueError(problem)


def refuse_settings_a_given_optimizer_ignores(args: DecentralizedTrainingArguments, model,
                                              optimizer_cls_and_kwargs) -> None:
    """With ``optimizer_cls_and_kwargs`` transformers builds each node's optimizer from that pair
    alone (``weight_decay`` still sets its parameter groups): ``optim_args`` and ``adam_*`` away
    from their defaults would be dropped without a word, and ``learning_rate`` too (the LR is the
    pair's ``lr``, or the optimizer's own default): ValueError naming the first such setting,
    unless ``learning_rate`` equals the pair's ``lr``. ``optim`` may stay at its default or name
    the pair's optimizer (or a base class of it: the checks of the arguments that follow
    ``optim``, e.g. ``qgm_beta`` with SGD, then hold for the pair); another is refused."""
    optimizer_cls, kwargs = optimizer_cls_and_kwargs
    name = getattr(optimizer_cls, "__name__", type(optimizer_cls).__name__)
    if not is_default(args, "optim"):
        optim = getattr(args.optim, "value", args.optim)
        optim_cls = Trainer.get_optimizer_cls_and_kwargs(args, model)[0]
        same = isinstance(optimizer_cls, type) and isinstance(optim_cls, type) and issubclass(optimizer_cls, optim_cls)
        if not same:
            raise ValueError(f"optim={optim!r} builds {getattr(optim_cls, '__name__', optim_cls)}, and "
                             f"optimizer_cls_and_kwargs builds {name}: transformers builds the pair's and ignores "
                             f"optim; leave optim at {field_default(args, 'optim')!r} or name the same optimizer")
    for field_name in ("optim_args", *ADAM_SETTINGS):
        if not is_default(args, field_name):
            value = getattr(args, field_name)
            raise ValueError(f"{field_name}={getattr(value, 'value', value)!r} is not read when "
                             f"optimizer_cls_and_kwargs builds the optimizer ({name}: transformers ignores it): put "
                             f"the setting in its keyword arguments and leave {field_name} at "
                             f"{field_default(args, field_name)!r}")
    if not is_default(args, "learning_rate") and kwargs.get("lr") != args.learning_rate:
        has = f"lr={kwargs['lr']!r}" if "lr" in kwargs else f"no lr, so {name}'s default"
        raise ValueError(f"learning_rate={args.learning_rate!r} is not read when optimizer_cls_and_kwargs builds the "
                         f"optimizer: its keyword arguments set the LR ({has}); pass lr={args.learning_rate!r} "
                         "in them")


def cost_optimizer(args: DecentralizedTrainingArguments, model, optimizer_cls_and_kwargs=None,
                   warn: bool = False) -> str:
    """The name under which the cost model (SPEC 7, ``lp_decentral_nlp.cost.OPTIMIZER_STATES``)
    prices the state this run's optimizer keeps per parameter: ``"sgd"`` (SGD without momentum,
    transformers' ``optim="sgd"`` unless ``optim_args`` give one), ``"momentum"``, ``"adam"``
    (Adam/AdamW), ``"sgd_qgm"`` / ``"adam_qgm"`` with quasi-global momentum. Any other optimizer is
    priced as Adam, two tensors per parameter (Adafactor keeps less, Lion one): with `warn`, a
    warning says so."""
    if optimizer_cls_and_kwargs is None:
        optimizer_cls_and_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    optimizer_cls, kwargs = optimizer_cls_and_kwargs
    if isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.SGD):
        if args.qgm:
            return "sgd_qgm"
        return "momentum" if float(kwargs.get("momentum", 0.0)) > 0 else "sgd"
    if warn and not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Adam)):
        name = getattr(optimizer_cls, "__name__", type(optimizer_cls).__name__)
        logger.warning(f"cost report: {name} keeps its own state per parameter, which the cost model prices as "
                       "Adam's (two tensors per parameter; Adafactor keeps less, Lion and RMSprop one)")
    return "adam_qgm" if args.qgm else "adam"


def milestone_steps(milestones, steps_per_epoch: int) -> list[int]:
    """The optimizer steps after which the multi-step schedule multiplies the LR by ``lr_decay``:
    ``max(1, round(epoch * steps_per_epoch))`` of each ``lr_milestones`` epoch."""
    return [max(1, round(epoch * steps_per_epoch)) for epoch in milestones]


#: ``lr_scheduler_type`` values whose schedule steps on an evaluation metric, not on every
#: optimizer step (Trainer: ``ReduceLROnPlateau`` and ``GreedyLR``)
METRIC_SCHEDULES = frozenset({"reduce_lr_on_plateau", "greedy"})


class OptimizerMixin:
    """The optimizer side of :class:`~lp_decentral_nlp.trainer.DecentralizedTrainer`."""

    def _schedule_steps_on_metric(self) -> bool:
        """Whether the nodes' LR schedules step after evaluations (:data:`METRIC_SCHEDULES`) rather
        than after every optimizer step."""
        return not self.args.lr_milestones and str(getattr(self.args.lr_scheduler_type, "value",
                                                           self.args.lr_scheduler_type)) in METRIC_SCHEDULES

    def _step_schedules_on_metric(self, metrics: dict) -> None:
        """After an evaluation during training, as `Trainer` does: each node's metric-driven schedule
        (``reduce_lr_on_plateau``, ``greedy``) steps with the averaged model's
        ``metric_for_best_model`` (``eval_loss`` unless set), the same value on every node and rank.
        KeyError naming the metrics there are when it is missing."""
        if not self._schedule_steps_on_metric():
            return
        key = self.args.metric_for_best_model
        key = key if key.startswith("eval_") else f"eval_{key}"
        if key not in metrics:
            raise KeyError(f"lr_scheduler_type={self.args.lr_scheduler_type!r} steps on metric_for_best_model "
                           f"{key!r}, which the evaluation did not return; it returned {sorted(metrics)}")
        for scheduler in self.node_schedulers:
            scheduler.step(metrics[key])

    def _make_optimizer_and_scheduler(self, node_model, max_steps, steps_per_epoch):
        """Each node's own optimizer and LR schedule, built by `Trainer`'s factories from ``args``
        (``create_optimizer(node_model)``, which a subclass may override; ValueError when what it
        returns holds parameters that are not ``node_model``'s, which would leave the node untrained).

        With QGM and SGD the optimizer's own momentum is switched off (``momentum = 0``): the
        quasi-global buffer takes its place (SPEC 2); with Adam/AdamW the optimizer only holds the
        parameter groups and the LR, :class:`~lp_decentral_nlp.gossip.QuasiGlobalAdam` takes the
        step (:meth:`_build_qgm`). With
        ``args.lr_milestones`` the schedule is ``MultiStepLR``: the LR is multiplied by
        ``args.lr_decay`` after step ``max(1, round(epoch * steps_per_epoch))`` of each milestone.
        """
        self.optimizer, self.lr_scheduler = None, None
        optimizer = self.create_optimizer(node_model)
        own = {id(p) for p in node_model.parameters()}
        held = [p for group in optimizer.param_groups for p in group["params"]]
        if not held or any(id(p) not in own for p in held):
            raise ValueError("create_optimizer(model) returned an optimizer over parameters that are not the given "
                             "model's: DecentralizedTrainer calls it once per node with that node's model, so build "
                             "the optimizer over model, not self.model")
        if self.args.qgm and isinstance(optimizer, torch.optim.SGD):
            for group in optimizer.param_groups:
                group["momentum"] = 0.0
        if self.args.lr_milestones:
            milestones = milestone_steps(self.args.lr_milestones, steps_per_epoch)
            scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones, gamma=self.args.lr_decay)
        else:
            scheduler = self.create_scheduler(max_steps, optimizer=optimizer)
        self.optimizer, self.lr_scheduler = None, None
        return optimizer, scheduler

    def _continue_schedules_over(self, resumed_max_steps: int, max_steps: int) -> None:
        """After a checkpoint was restored into a run of another length (``max_steps`` in all, from
        ``max_steps`` or ``num_train_epochs``, where the interrupted run had ``resumed_max_steps``):
        Trainer's step schedules (``linear``, ``cosine``, warmup by ``warmup_ratio``...) are
        functions of the total, so each node's LR is set at once to its schedule over the new total
        at the checkpoint's step (the restored optimizer still holds the old schedule's LR, and
        would train one more step with it), with a warning giving both LRs: extending a finished
        linear schedule lifts the LR from 0 back up. The resume is not refused: training longer is
        a reason to resume. Schedules that do not depend on the total (``constant``,
        ``lr_milestones``, metric-driven ones) are left as restored."""
        if resumed_max_steps == max_steps or not isinstance(self.node_schedulers[0], torch.optim.lr_scheduler.LambdaLR):
            return
        resumed_lr = self.node_schedulers[0].get_last_lr()[0]
        for scheduler, optimizer in zip(self.node_schedulers, self.node_optimizers):
            for group, base_lr, lr_at in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
                group["lr"] = base_lr * lr_at(scheduler.last_epoch)
        new_lr = self.node_optimizers[0].param_groups[0]["lr"]
        if abs(new_lr - resumed_lr) <= 1e-6 * abs(resumed_lr) or not self.state.is_world_process_zero:
            return
        schedule = getattr(self.args.lr_scheduler_type, "value", self.args.lr_scheduler_type)
        logger.warning(f"resuming at step {self.node_schedulers[0].last_epoch} a run of {resumed_max_steps} steps "
                       f"with {max_steps} steps in all: the {schedule} learning-rate schedule is recomputed over "
                       f"{max_steps} steps and the LR continues from {new_lr:.3g}, where the interrupted run's "
                       f"schedule was at {resumed_lr:.3g}. To continue that run as it was, resume with its "
                       f"max_steps or num_train_epochs")

    @contextlib.contextmanager
    def _schedule_order_warning_hidden(self):
        """Hide torch's "lr_scheduler.step() before optimizer.step()" warning while training: every
        node's LR schedule follows the global step by design, also where the node's first
        ``optimizer.step()`` does not come first (a node absent under the fault plan, an update
        skipped by ``skip_nonfinite`` or by the float16 loss scaler, and
        :class:`~lp_decentral_nlp.gossip.QuasiGlobalAdam`, which steps in its place). Enter it once
        per ``train()``: leaving ``warnings.catch_warnings`` re-arms every warning Python shows
        once per place, so around each step it would repeat a model's warning every step."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            yield

    def _build_qgm(self):
        """The quasi-global momentum of the local nodes (SPEC 2), for the optimizers just built.

        SGD: :class:`~lp_decentral_nlp.gossip.QuasiGlobalMomentum` with ``args.qgm_beta``, added
        to the gradient before ``optimizer.step()``. Adam/AdamW: one
        :class:`~lp_decentral_nlp.gossip.QuasiGlobalAdam` over the local nodes that replaces
        ``optimizer.step()`` (the quasi-global buffer is Adam's first moment, the second moment
        stays local), with ``betas`` and ``eps`` of the optimizer's parameter groups and each
        parameter's weight decay from the group holding it (Trainer: ``weight_decay`` for weights,
        0 for biases and LayerNorm weights; 0 for a parameter outside every group). ValueError
        for settings QuasiGlobalAdam cannot honour (amsgrad, maximize, L2 weight decay of
        ``torch.optim.Adam``, groups with different betas or eps) and parameter groups with different
        LRs (the momentum is recovered from the whole model change divided by one LR).
        """
        optimizer = self.node_optimizers[0]
        groups = optimizer.param_groups
        if len({group["lr"] for group in groups}) > 1:
            raise ValueError(f"qgm=True needs one lr for every parameter group of the optimizer (the quasi-global "
                             f"momentum is the model's whole change divided by it), got {[g['lr'] for g in groups]}")
        if isinstance(optimizer, torch.optim.SGD):
            return gossip_lib.QuasiGlobalMomentum(self.node_params, beta=self.args.qgm_beta)
        for option in ("amsgrad", "maximize"):
            if any(group.get(option) for group in groups):
                raise ValueError(f"qgm=True with Adam {option}=True: QuasiGlobalAdam runs plain Adam/AdamW; "
                                 f"set {option}=False or qgm=False")
        if any(group["weight_decay"] and not group.get("decoupled_weight_decay") for group in groups):
            raise ValueError("qgm=True with torch.optim.Adam and weight_decay > 0 (L2 added to the gradient): "
                             "QuasiGlobalAdam decays decoupled, as AdamW: use optim='adamw_torch' or weight_decay=0")
        for key in ("betas", "eps"):
            if len({group[key] for group in groups}) > 1:
                raise ValueError(f"qgm=True needs one {key} for every parameter group of the optimizer, got "
                                 f"{[group[key] for group in groups]}")
        decay = {id(p): group["weight_decay"] for group in groups for p in group["params"]}
        return gossip_lib.QuasiGlobalAdam(
            self.node_params, betas=tuple(groups[0]["betas"]), eps=groups[0]["eps"],
            weight_decay=[float(decay.get(id(p), 0.0)) for p in self.nodes[0].parameters() if p.requires_grad])
