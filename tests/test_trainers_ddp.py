"""remat's trainer callbacks when the trainer trains through ``DistributedDataParallel``.

On 2 gloo ranks, each with its own data: Lightning's ``DDPStrategy`` and Hugging Face's
``Trainer`` under a distributed launch (accelerate trains DDP on CPU) wrap the model in
DDP before the callback plans. The callback must take the DDP route
(:mod:`remat.tune.replicated`): one plan on every rank (each rank alone could pick
another), the Reducer's gradient buckets in the prediction, the verification's step
run through the wrapper, and the trainer's own measured step (buckets included) within
the budget. Before, the callbacks planned the module inside the wrapper alone: the
buckets (the size of the gradients) were missing from the plan and from the trainer's
step as measured, and ranks could apply different plans.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

pytest.importorskip("torch.distributed.fsdp")  # test_fsdp_collective's spawn helper

from test_fsdp_collective import WORLD, _spawn  # noqa: E402

WIDTH = 64


def _rank_setup(rank: int) -> None:
    """Trainers read the launch from the environment; the spawn helper's process group
    is up already."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))


def _same_on_every_rank(text: str) -> bool:
    import torch.distributed as dist

    found: list = [None] * WORLD
    dist.all_gather_object(found, text)
    return all(t == found[0] for t in found)


def _check_planned_through(ddp: nn.parallel.DistributedDataParallel, report: object) -> None:
    """The report's plan was made on the DDP route: the same on every rank, the buckets
    in its persistent bytes, and the trainer's step (buckets counted) within budget."""
    from remat.measurement.storage import bucket_bytes, fixed_bytes

    plan = report.plan
    buckets = bucket_bytes(ddp, grads=False)
    params = sum(p.numel() * p.element_size() for p in ddp.parameters())
    assert buckets >= params > 0
    assert set(plan.options) != {"keep"}, plan.summary()
    assert _same_on_every_rank(plan.to_json()), "one plan on every rank"
    # Parameters, their gradients, AdamW's two moments and the buckets: the buckets are
    # what the plan of the module alone left out.
    assert plan.record.persistent_bytes >= 4 * params + buckets, (plan.record, buckets)
    step = report.trainer_step
    assert step is not None
    assert step.resident_bytes >= fixed_bytes(ddp.module, None) + buckets
    assert step.peak_bytes <= report.budget_bytes, (step, report.budget_bytes)
    print(f"\n{plan.summary()}: budget {report.budget_bytes} B, predicted "
          f"{plan.record.predicted_peak_bytes} B, verified {plan.verification.measured_peak_bytes}"
          f" B, the trainer's step {step.peak_bytes} B, buckets {buckets} B", flush=True)


# --------------------------------------------------------------------------- Lightning
def _check_lightning_ddp(rank: int, **ddp_kwargs: bool) -> None:
    L = pytest.importorskip("lightning")
    from lightning.pytorch.strategies import DDPStrategy
    from test_lightning import Net  # its training_step logs: muted while remat profiles

    from remat.integrations.lightning import RematCallback

    _rank_setup(rank)
    gen = torch.Generator().manual_seed(rank)  # each rank its own data
    data = torch.utils.data.TensorDataset(torch.randn(512, WIDTH, generator=gen),
                                          torch.randint(0, 10, (512,), generator=gen))
    class Wrapper(L.Callback):  # the strategy's wrapper, while fitting (teardown drops it)
        ddp = None

        def on_train_end(self, trainer, pl_module) -> None:
            Wrapper.ddp = trainer.strategy.model

    callback = RematCallback(memory_budget="60%")
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=WORLD,
                        strategy=DDPStrategy(process_group_backend="gloo", **ddp_kwargs),
                        callbacks=[callback, Wrapper()], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    module = Net()
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=128))
    ddp = Wrapper.ddp
    assert isinstance(ddp, nn.parallel.DistributedDataParallel) and ddp.module is module
    assert trainer.global_step == 3 and callback.report is not None
    _check_planned_through(ddp, callback.report)


def _check_lightning_ddp_static_graph(rank: int) -> None:
    _check_lightning_ddp(rank, static_graph=True)


def _check_lightning_ddp_unused(rank: int) -> None:
    _check_lightning_ddp(rank, find_unused_parameters=True)


@pytest.mark.slow
def test_lightning_ddp_strategy_plans_through_the_wrapper(free_port: int) -> None:
    _spawn(_check_lightning_ddp, free_port)


@pytest.mark.slow
@pytest.mark.parametrize("check", [_check_lightning_ddp_static_graph, _check_lightning_ddp_unused],
                         ids=["static_graph", "find_unused_parameters"])
def test_lightning_ddp_with_ddps_graph_settings(check, free_port: int) -> None:
    """DDP's ``static_graph`` (its graph recorded at the first step, buckets rebuilt
    then) and ``find_unused_parameters`` (the output's graph searched every forward)."""
    _spawn(check, free_port)


# --------------------------------------------------------------------------- HF Trainer
def _check_hf_ddp(rank: int, outside_loss: bool) -> None:
    pytest.importorskip("transformers")
    import tempfile

    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from remat.integrations.hf import RematCallback

    _rank_setup(rank)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=256,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (32, 64), generator=torch.Generator().manual_seed(rank))
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=8, max_steps=3, report_to=[],
            save_strategy="no", logging_strategy="no", use_cpu=True, ddp_backend="gloo",
            label_smoothing_factor=0.1 if outside_loss else 0.0, bf16=not outside_loss)
        callback = RematCallback(memory_budget="60%")
        trainer = Trainer(model=model, args=args, callbacks=[callback],
                          train_dataset=[{"input_ids": r, "labels": r} for r in ids])
        trainer.train()
    ddp = trainer.model_wrapped
    assert isinstance(ddp, nn.parallel.DistributedDataParallel) and ddp.module is model
    assert callback.report is not None
    _check_planned_through(ddp, callback.report)


def _check_hf_ddp_model_loss(rank: int) -> None:
    _check_hf_ddp(rank, outside_loss=False)


def _check_hf_ddp_trainer_loss(rank: int) -> None:
    _check_hf_ddp(rank, outside_loss=True)


@pytest.mark.slow
def test_hf_trainer_under_ddp_plans_through_the_wrapper(free_port: int) -> None:
    """The model's own loss, with ``bf16=True`` (accelerate's autocast around the
    wrapper's forward)."""
    _spawn(_check_hf_ddp_model_loss, free_port)


@pytest.mark.slow
def test_hf_trainer_loss_outside_the_model_under_ddp_plans_through_the_wrapper(
        free_port: int) -> None:
    """The Trainer's own ``compute_loss`` (label smoothing), run through the wrapper."""
    _spawn(_check_hf_ddp_trainer_loss, free_port)
