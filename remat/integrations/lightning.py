"""remat for Lightning: one callback plans ``trainer.fit`` for a memory budget.

::

    from remat.integrations.lightning import RematCallback

    trainer = L.Trainer(callbacks=[RematCallback(memory_budget="8GB")], ...)
    trainer.fit(module, datamodule)

**The contract.** remat measures what one training step costs, so it must run that
step. By default the step is the LightningModule's own ``training_step(batch, 0)``:
its result is the loss (a tensor, or a dict with a ``"loss"`` key, as Lightning's
automatic optimization takes it). While remat profiles, ``self.log`` and
``self.log_dict`` are muted (they would log the profiling runs, and Lightning only
allows them inside its loop). A ``training_step`` that has side effects beyond
logging (counters, manual optimization) needs ``step=``: a function
``step(module, batch) -> loss`` that computes the loss the same way without them.
Manual optimization (``automatic_optimization = False``) is refused: its
``training_step`` runs backward and the optimizer itself.

**When.** At ``on_train_start``: Lightning has set the optimizer up (its state and
step count towards the budget), moved the model to its device and built the train
data loader. The callback takes the loader's first batch (moved to the device by
the strategy, with the module's batch-transfer hooks) unless ``batch=`` gives one,
describes the loop from the Trainer (``accumulate_grad_batches``; ``precision``
``"bf16-mixed"`` / ``"16-mixed"`` is autocast, the latter with a gradient scaler),
solves with :func:`remat.solve` (which verifies the plan by measuring it) and applies
the plan to the LightningModule in place. At optimizer step ``measure_step`` it
measures the Trainer's own step. The figures are logged on the ``remat`` logger and
kept in :attr:`RematCallback.report`; the plan stays applied after ``fit``
(``remat.remove_plan(module)`` takes it off).

**Distributed.** Under ``DDPStrategy`` every rank's callback plans together through
:mod:`remat.tune.replicated`: the wrapper's gradient buckets counted, the verification's
step run through the wrapper (its all-reduces), the worst rank's figures, one plan for
every rank. Under ``ModelParallelStrategy`` (FSDP2) the sharded route
(:mod:`remat.tune.sharded`) does the same for the sharded module.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from lightning.pytorch import Callback
from torch import nn

from remat.core.loop import Loop
from remat.core.settings import ProfilingSettings, Verify, verify_setting
from remat.integrations.common import CallbackSettings, IntegrationError, RunReport, solve_plan
from remat.measurement.step_meter import StepMeter, unwrap_optimizer
from remat.tune.replicated import ReplicatedStep

__all__ = ["RematCallback", "lightning_loop"]

log = logging.getLogger("remat")

StepFn = Callable[[Any, Any], Any]

# Lightning's precision setting -> (autocast dtype, gradient scaler).
_MIXED = {"bf16-mixed": ("bfloat16", False), "16-mixed": ("float16", True),
          "16": ("float16", True), "bf16": ("bfloat16", False)}


def lightning_loop(trainer: Any) -> Loop:
    """The loop of a Lightning ``Trainer`` with automatic optimization: it drops the
    step's output once the loss is taken, accumulates ``accumulate_grad_batches``
    micro-batches, and autocasts under a ``"*-mixed"`` precision.

    Lightning zeroes the gradients inside its closure *after* ``training_step`` (the
    forward) and before ``backward``, so the previous step's gradients are alive
    through every forward; ``set_to_none=False`` (gradients alive through the whole
    step) is the loop that counts them, a bound (a planned model's guard warned that
    the plan for ``set_to_none=True`` left them out)."""
    autocast, scaler = _MIXED.get(str(trainer.precision), (None, False))
    return Loop(accumulation_steps=int(trainer.accumulate_grad_batches), keep_output=False,
                set_to_none=False, autocast=autocast, grad_scaler=scaler)


def _strategy_ddp(trainer: Any) -> nn.parallel.DistributedDataParallel | None:
    """The ``DistributedDataParallel`` wrapper the Trainer's strategy trains through
    (``DDPStrategy`` and its kin), else ``None``."""
    model = getattr(trainer.strategy, "model", None)
    return model if isinstance(model, nn.parallel.DistributedDataParallel) else None


def _default_step(module: Any, batch: Any) -> Any:
    return module.training_step(batch, 0)


def _the_loss(result: Any) -> torch.Tensor:
    loss = result.get("loss") if isinstance(result, Mapping) else result
    if not isinstance(loss, torch.Tensor):
        raise IntegrationError(
            f"RematCallback: the training step returned {type(result).__name__}, not a loss "
            "tensor (or a dict with a 'loss' key); pass step=fn, where fn(module, batch) "
            "returns the loss")
    return loss


class _TrainingStep(ReplicatedStep):
    """The LightningModule's training step as a module remat can profile: its units are
    the module's own (under ``module.``), its output the loss. Under ``DDPStrategy``
    (``replicated_by``: the strategy's wrapper) the route of :mod:`remat.tune.replicated`
    runs it through the wrapper where Lightning would (:func:`_redirected`)."""

    def __init__(self, module: nn.Module, step: StepFn,
                 replicated_by: nn.parallel.DistributedDataParallel | None = None) -> None:
        super().__init__(replicated_by)
        self.module = module
        self._step = step

    def step(self, batch: Any) -> torch.Tensor:
        return _the_loss(self._step(self.module, batch))

    def step_through(self, ddp: nn.parallel.DistributedDataParallel,
                     batch: Any) -> torch.Tensor:
        return _the_loss(_redirected(ddp, self.module, self._step, batch))


def _redirected(wrapper: nn.Module, module: nn.Module, step: StepFn, batch: Any) -> Any:
    """``step(module, batch)`` run inside ``wrapper``'s forward, as Lightning's strategies
    run ``training_step`` (their forward redirection): ``module.forward`` is swapped for
    the step while the wrapper's forward runs, so the wrapper does what it does around
    its module's forward (DDP: the Reducer's preparation for backward) around the step.
    The swap is undone before the step runs (the step calls the module's own forward),
    leaving ``module`` as it was (Lightning's own leaves its bound ``forward`` behind)."""
    had, saved = "forward" in vars(module), vars(module).get("forward")

    def undo() -> None:
        if had:
            vars(module)["forward"] = saved
        else:
            vars(module).pop("forward", None)

    def forward(inputs: Any) -> Any:
        undo()
        return step(module, inputs)

    vars(module)["forward"] = forward
    try:
        return wrapper(batch)
    finally:
        undo()


@contextlib.contextmanager
def _muted_logging(module: Any) -> Iterator[None]:
    """``module.log`` / ``log_dict`` do nothing inside (instance attributes, removed after)."""
    names = [n for n in ("log", "log_dict") if n not in vars(module)]
    for name in names:
        setattr(module, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name in names:
            vars(module).pop(name, None)


class RematCallback(Callback):
    """Plan activation checkpointing for a Lightning ``fit`` under a memory budget.

    Args:
        memory_budget: the peak one training step may reach on the device: bytes,
            ``"8GB"``, ``"50%"`` (of the activation memory), ``"70% of peak"``.
        step: ``step(module, batch) -> loss`` (a tensor, or a dict with ``"loss"``);
            default ``module.training_step(batch, 0)`` with logging muted.
        batch: the batch to plan for, on the module's device; default the first
            batch of the Trainer's train data loader.
        method, units, options, verify, include_optimizer, measure_step,
        **solver_params: as for :class:`remat.integrations.hf.RematCallback`.

    Attributes:
        report: the :class:`~remat.integrations.common.RunReport` once fitting has
            started.
    """

    def __init__(
        self,
        memory_budget: int | str,
        *,
        step: StepFn | None = None,
        batch: Any = None,
        method: str = "optimal",
        units: Any = None,
        options: Any = None,
        verify: bool | Verify = True,
        include_optimizer: bool = True,
        measure_step: int | None = 1,
        **solver_params: Any,
    ) -> None:
        if step is not None and not callable(step):
            raise IntegrationError(f"RematCallback(step={step!r}): need a callable "
                                   "step(module, batch) -> loss")
        self.settings = CallbackSettings(
            memory_budget, method, ProfilingSettings(units=units, options=options),
            verify_setting(verify, owner="RematCallback"), include_optimizer, measure_step,
            dict(solver_params))
        self.step = step or _default_step
        self.batch = batch
        self.report: RunReport | None = None
        self._meter: StepMeter | None = None

    @property
    def plan(self) -> Any:
        """The plan applied to the LightningModule (``None`` before fitting starts)."""
        return None if self.report is None else self.report.plan

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not pl_module.automatic_optimization:
            raise IntegrationError(
                "RematCallback needs automatic optimization: with automatic_optimization = "
                "False the training_step runs backward and the optimizer itself, so remat "
                "cannot run one step of it; plan with remat.solve(model, batch, ...) instead")
        if len(trainer.optimizers) > 1:
            raise IntegrationError("RematCallback plans for one optimizer; the Trainer has "
                                   f"{len(trainer.optimizers)}")
        from remat.runtime import planned

        if self.report is not None and planned(pl_module) is not None:
            log.info("remat: the plan is applied already (fit called again)")
            return
        batch = self.batch if self.batch is not None else self._first_batch(trainer)
        optimizer = unwrap_optimizer(trainer.optimizers[0]) if trainer.optimizers else None
        loop = lightning_loop(trainer)
        ddp = _strategy_ddp(trainer)
        wrapper = _TrainingStep(pl_module, self.step, replicated_by=ddp)
        with _muted_logging(pl_module):
            plan = solve_plan(wrapper, (batch,), loop, optimizer, self.settings,
                              loss_fn=lambda loss, _batch: loss)
        # The units were named inside the wrapper ("module.<name>"): name them in the module.
        plan = plan.with_(unit_names=tuple(n.removeprefix("module.") for n in plan.unit_names))
        from remat.api import apply_plan

        apply_plan(pl_module, plan)
        self.report = RunReport.of(plan, loop)
        log.info("%s", self.report.summary())
        # Through the wrapper, if any: its gradient buckets are part of the step.
        self._meter = StepMeter(ddp if ddp is not None else pl_module, optimizer,
                                count_grads=False)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        accumulation = int(trainer.accumulate_grad_batches)
        if (self._meter is not None and not self._meter.running and self.report is not None
                and self.report.trainer_step is None and batch_idx % accumulation == 0
                and trainer.global_step == self.settings.measure_step):
            self._meter.start()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        accumulation = int(trainer.accumulate_grad_batches)
        if (self._meter is not None and self._meter.running and self.report is not None
                and (batch_idx + 1) % accumulation == 0):
            self.report.trainer_step = self._meter.stop()
            self.report.measured_at_step = self.settings.measure_step
            log.info("%s", self.report.summary())
            self.report.check_trainer_step()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._meter is not None and self._meter.running:
            self._meter.abandon()

    @staticmethod
    def _first_batch(trainer: Any) -> Any:
        loader = trainer.train_dataloader
        if not isinstance(loader, torch.utils.data.DataLoader):
            raise IntegrationError(
                "RematCallback takes the first batch of one train DataLoader, and the Trainer "
                f"has {type(loader).__name__}; pass RematCallback(batch=...) on the device")
        try:
            batch = next(iter(loader))
        except StopIteration:
            raise IntegrationError("RematCallback: the train data loader is empty") from None
        return trainer.strategy.batch_to_device(batch)
