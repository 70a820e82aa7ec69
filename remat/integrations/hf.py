"""remat for Hugging Face's ``Trainer``: one callback plans the run for a memory budget.

::

    from remat.integrations.hf import RematCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[RematCallback(memory_budget="8GB")])
    trainer.train()

At ``on_train_begin`` (transformers 5 calls it after creating the optimizer and
preparing the model and the data loader) the callback takes the first batch of the
Trainer's own train data loader, describes the Trainer's loop from its arguments
(:meth:`remat.Loop.hf_trainer`: gradient accumulation, ``bf16`` / ``fp16``, the
output dropped after the loss), and solves with the Trainer's optimizer, so its
state and its step count towards the budget. :func:`remat.solve` verifies the plan by
measuring a step; the callback applies it to the model in place and, at optimizer
step ``measure_step`` (default 1, the second: the first creates the optimizer's
state), measures the Trainer's own step. The figures are logged on the ``remat``
logger, kept in :attr:`RematCallback.report`, and appended to the Trainer's
``state.log_history`` (so ``trainer_state.json`` has them) when training ends.

**The loss the Trainer really computes.** With ``label_smoothing_factor > 0``, a
``compute_loss_func`` or a subclass that overrides ``compute_loss``, the Trainer takes
the loss from the model's output outside the model (the logits alive until it is
taken): the callback then plans the Trainer's own ``compute_loss`` (a wrapper module
whose forward calls it, as the Lightning callback plans ``training_step``), with no
chunked head (the loss is not the model's). It finds the Trainer on the call stack of
``on_train_begin``; where it cannot, it plans the model's own loss and says so.
accelerate's mixed-precision wrapper of ``model.forward`` stays in place: remat never
replaces a forward (:mod:`remat.execute.lazy_logits`).

**Distributed.** Where the Trainer trains through ``DistributedDataParallel`` (a
``torchrun`` launch; on CPU, accelerate trains DDP over gloo), every rank's callback
plans together through :mod:`remat.tune.replicated`: the gradient buckets counted, the
verification's step run through the wrapper, one plan for every rank.

The plan stays applied after training (evaluation and generation run without
grad, where a plan costs nothing); ``remat.remove_plan(model)`` takes it off.

Do not also turn on the Trainer's ``gradient_checkpointing`` /
``activation_checkpointing``: the layers would be recomputed twice, so the callback
refuses it (an :class:`~remat.integrations.common.IntegrationError`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback

from remat.core.loop import Loop
from remat.core.settings import ProfilingSettings, Verify, verify_setting
from remat.integrations.common import CallbackSettings, IntegrationError, RunReport, solve_plan
from remat.measurement.step_meter import StepMeter, unwrap_optimizer
from remat.tune.replicated import ReplicatedStep

__all__ = ["RematCallback"]

log = logging.getLogger("remat")


def _hf_checkpointing_on(args: Any, model: Any) -> bool:
    flags = [getattr(args, name, False) for name in ("activation_checkpointing",
                                                     "gradient_checkpointing")]
    # transformers 5 renamed the model's flag; the old name warns there.
    on_model = getattr(model, "is_activation_checkpointing", None)
    if on_model is None:
        on_model = getattr(model, "is_gradient_checkpointing", False)
    return any(f is True for f in flags) or on_model is True


def _calling_trainer() -> Trainer | None:
    """The ``Trainer`` whose event is being handled: the nearest ``self`` on the call stack
    that is one (callbacks are not handed their Trainer)."""
    frame = inspect.currentframe()
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


def _loss_outside_the_model(trainer: Trainer | None, args: Any) -> tuple[Trainer, str] | None:
    """``(trainer, why)`` where the Trainer computes the loss from the model's output
    outside the model (see the module docstring), else ``None``."""
    if trainer is None:
        if getattr(args, "label_smoothing_factor", 0):
            log.warning("remat: label_smoothing_factor=%s and the Trainer was not found on the "
                        "call stack: planning the model's own loss, which the Trainer does not "
                        "compute", args.label_smoothing_factor)
        return None
    if getattr(trainer, "label_smoother", None) is not None:
        return trainer, f"label_smoothing_factor={args.label_smoothing_factor}"
    if getattr(trainer, "compute_loss_func", None) is not None:
        return trainer, "compute_loss_func"
    if type(trainer).compute_loss is not Trainer.compute_loss:
        return trainer, f"{type(trainer).__name__}.compute_loss"
    return None


class _TrainerLoss(ReplicatedStep):
    """The Trainer's ``compute_loss`` as a module remat can profile: its units are the
    model's own (under ``model.``), its output the loss. Under DDP (``replicated_by``:
    the Trainer's wrapped model) the route of :mod:`remat.tune.replicated` runs it on the
    wrapper, as the Trainer's ``training_step`` does."""

    def __init__(self, model: nn.Module, trainer: Trainer,
                 replicated_by: nn.parallel.DistributedDataParallel | None = None) -> None:
        super().__init__(replicated_by)
        self.model = model
        self._trainer = trainer

    def step(self, batch: Any) -> torch.Tensor:
        return self._loss(self.model, batch)

    def step_through(self, ddp: nn.parallel.DistributedDataParallel,
                     batch: Any) -> torch.Tensor:
        return self._loss(ddp, batch)

    def _loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        inputs = dict(batch) if isinstance(batch, Mapping) else batch  # compute_loss pops
        return self._trainer.compute_loss(model, inputs)


def _trainer_ddp(trainer: Trainer | None,
                 model: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    """The ``DistributedDataParallel`` wrapper the Trainer trains ``model`` through (what
    accelerate made of it under a distributed launch, on CPU too), else ``None``."""
    wrapped = getattr(trainer, "model_wrapped", None)
    if isinstance(wrapped, nn.parallel.DistributedDataParallel) and wrapped.module is model:
        return wrapped
    return None


class RematCallback(TrainerCallback):
    """Plan activation checkpointing for a ``transformers.Trainer`` run under a budget.

    Args:
        memory_budget: the peak one training step may reach on the device: bytes,
            ``"8GB"``, ``"7.5GiB"``, ``"50%"`` (of the activation memory) or ``"70% of
            peak"`` (checked when the callback is made).
        method: the solver (:func:`remat.solve`'s ``method``).
        loss_fn: ``loss_fn(output, batch)``; default the output's ``.loss``, which the
            Trainer uses too when the batch has ``labels``.
        units, options: as for :func:`remat.profile`.
        verify: let :func:`remat.solve` measure its plan (and re-solve when over):
            ``True``, ``False`` or ``remat.Verify(rounds=..., steps=...)``.
        include_optimizer: count the Trainer's optimizer (its state and step).
        measure_step: the optimizer step (0-based) of the Trainer to measure; ``None``
            measures none.
        **solver_params: passed to the solver (``time_limit_s`` for ``"ilp"``...).

    Attributes:
        report: the :class:`~remat.integrations.common.RunReport` once training has
            started (plan, budget, predicted peak, measured peaks).
    """

    def __init__(
        self,
        memory_budget: int | str,
        *,
        method: str = "optimal",
        loss_fn: Any = None,
        units: Any = None,
        options: Any = None,
        verify: bool | Verify = True,
        include_optimizer: bool = True,
        measure_step: int | None = 1,
        **solver_params: Any,
    ) -> None:
        self.settings = CallbackSettings(
            memory_budget, method, ProfilingSettings(loss_fn=loss_fn, units=units, options=options),
            verify_setting(verify, owner="RematCallback"), include_optimizer, measure_step,
            dict(solver_params))
        self.report: RunReport | None = None
        self._meter: StepMeter | None = None

    @property
    def plan(self) -> Any:
        """The plan applied (``None`` before training starts)."""
        return None if self.report is None else self.report.plan

    # -- Trainer events ---------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._refuse_hf_checkpointing(args, kwargs.get("model"))

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        self._refuse_hf_checkpointing(args, model)
        loader = kwargs.get("train_dataloader")
        if model is None or loader is None:
            raise IntegrationError(
                "RematCallback: the Trainer passed no model or train_dataloader to "
                "on_train_begin (transformers >= 4.44 passes both); give the Trainer a "
                "train_dataset")
        from remat.runtime import planned

        if self.report is not None and planned(model) == self.report.plan:
            log.info("remat: the plan is applied already (train() called again)")
            return
        try:
            batch = next(iter(loader))
        except StopIteration:
            raise IntegrationError("RematCallback: the Trainer's train data loader is empty; "
                                   "there is no batch to plan for") from None
        optimizer = unwrap_optimizer(kwargs.get("optimizer"))
        loop = Loop.hf_trainer(args)
        calling = _calling_trainer()
        ddp = _trainer_ddp(calling, model)
        outside = _loss_outside_the_model(calling, args)
        if outside is None:
            # Under DDP, through the wrapper: every rank plans together, buckets counted.
            plan = solve_plan(model if ddp is None else ddp, batch, loop, optimizer,
                              self.settings)
        else:
            trainer, why = outside
            log.info("remat: the Trainer computes the loss outside the model (%s): planning its "
                     "compute_loss, with the head as written", why)
            wrapper = _TrainerLoss(model, trainer, replicated_by=ddp)
            plan = solve_plan(wrapper, (batch,), loop, optimizer, self.settings,
                              loss_fn=lambda loss, _batch: loss, head="none")
            # The units were named inside the wrapper ("model.<name>"): name them in the model.
            plan = plan.with_(unit_names=tuple(n.removeprefix("model.")
                                               for n in plan.unit_names))
        from remat.api import apply_plan

        apply_plan(model, plan)
        self.report = RunReport.of(plan, loop)
        log.info("%s", self.report.summary())
        # Through the wrapper, if any: its gradient buckets are part of the step.
        self._meter = StepMeter(model if ddp is None else ddp, optimizer)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if (self._meter is not None and not self._meter.running and self.report is not None
                and self.report.trainer_step is None
                and state.global_step == self.settings.measure_step):
            self._meter.start()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._meter is not None and self._meter.running and self.report is not None:
            self.report.trainer_step = self._meter.stop()
            self.report.measured_at_step = self.settings.measure_step
            log.info("%s", self.report.summary())
            self.report.check_trainer_step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._meter is not None and self._meter.running:
            self._meter.abandon()
        if self.report is not None:
            state.log_history.append({**self.report.to_dict(), "step": state.global_step})

    # -- checks -----------------------------------------------------------------------
    @staticmethod
    def _refuse_hf_checkpointing(args: Any, model: Any) -> None:
        if _hf_checkpointing_on(args, model):
            raise IntegrationError(
                "RematCallback plans activation checkpointing itself, and the Trainer's "
                "gradient_checkpointing (activation_checkpointing) is on too: the layers would "
                "be recomputed twice. Set TrainingArguments(gradient_checkpointing=False) and "
                "call model.gradient_checkpointing_disable(), or drop the callback")
