"""remat's trainer callbacks under the trainers' sharding strategies.

* Lightning's ``ModelParallelStrategy`` (FSDP2 through ``configure_model``) runs on CPU
  with gloo: on 2 ranks the callback plans the sharded module on every rank (the FSDP2
  route of :mod:`remat.tune.sharded`), one plan for both, and the Trainer's own step
  measures within the budget.
* Lightning's ``FSDPStrategy`` refuses a CPU accelerator ("requires a GPU accelerator"),
  and Hugging Face accelerate turns FSDP on only for GPU-like distributed types (on CPU
  the Trainer trains DDP and ignores ``fsdp``): their tests run on a CUDA device only.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

L = pytest.importorskip("lightning")
pytest.importorskip("torch.distributed.fsdp")

from test_fsdp_collective import WORLD, _spawn  # noqa: E402

WIDTH = 64
NO_CUDA = not torch.cuda.is_available()


class ShardedNet(L.LightningModule):
    """Four MLP blocks, each ``fully_shard``-ed in ``configure_model`` (FSDP2), then the root."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
            for _ in range(4))
        self.head = nn.Linear(WIDTH, 10)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _loader(rank: int = 0) -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(rank)
    data = torch.utils.data.TensorDataset(torch.randn(512, WIDTH, generator=gen),
                                          torch.randint(0, 10, (512,), generator=gen))
    return torch.utils.data.DataLoader(data, batch_size=128)


def _trainer(callback: object, strategy: object, accelerator: str, devices: int) -> L.Trainer:
    return L.Trainer(max_steps=2, accelerator=accelerator, devices=devices, strategy=strategy,
                     callbacks=[callback], logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)


def _check_model_parallel(rank: int) -> None:
    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy

    from remat.integrations.lightning import RematCallback

    # The process group is up (the spawn helper's); Lightning sees ranks made outside it.
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(WORLD))
    callback = RematCallback(memory_budget="90%")
    strategy = ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
    trainer = _trainer(callback, strategy, "cpu", WORLD)
    trainer.fit(ShardedNet(), _loader(rank))
    report = callback.report
    assert trainer.global_step == 2 and report is not None
    assert report.plan.target.world_size == WORLD
    assert set(report.plan.options) != {"keep"}, report.plan.summary()
    plans: list = [None] * WORLD
    dist.all_gather_object(plans, report.plan.to_json())
    assert plans[0] == plans[1], "one plan on every rank"
    step = report.trainer_step
    assert step is not None and step.peak_bytes <= report.budget_bytes, (step, report)


@pytest.mark.slow
def test_lightning_model_parallel_strategy_plans_every_rank_alike(free_port: int) -> None:
    _spawn(_check_model_parallel, free_port)


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA, reason="Lightning's FSDPStrategy requires a GPU accelerator")
def test_lightning_fsdp_strategy_on_cuda() -> None:
    """Lightning's FSDPStrategy needs a GPU accelerator (it refuses ``accelerator='cpu'``)."""
    from lightning.pytorch.strategies import FSDPStrategy

    from remat.integrations.lightning import RematCallback

    class Net(ShardedNet):
        def configure_model(self) -> None:  # FSDPStrategy wraps it itself (FSDP1)
            pass

    callback = RematCallback(memory_budget="90%")
    trainer = _trainer(callback, FSDPStrategy(), "cuda", 1)
    trainer.fit(Net(), _loader())
    report = callback.report
    assert report is not None and trainer.global_step == 2
    assert report.trainer_step is not None
    assert report.trainer_step.peak_bytes <= report.budget_bytes


@pytest.mark.gpu
@pytest.mark.transformers
@pytest.mark.skipif(NO_CUDA, reason="accelerate enables FSDP on GPU-like devices only (on CPU "
                    "the Trainer trains DDP and ignores fsdp)")
def test_hf_trainer_fsdp2_on_cuda(tmp_path: object) -> None:
    """accelerate turns FSDP on for GPU-like distributed types only: on CPU the Trainer
    trains DDP and ignores ``fsdp``, so this runs where CUDA is."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from remat.integrations.hf import RematCallback

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", WORLD_SIZE="1", RANK="0",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=64)
    ids = torch.randint(0, 128, (32, 32), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, report_to=[],
        save_strategy="no", logging_strategy="no", fsdp=True,
        fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    callback = RematCallback(memory_budget="90%")
    trainer = Trainer(model=LlamaForCausalLM(cfg), args=args, callbacks=[callback],
                      train_dataset=[{"input_ids": r, "labels": r} for r in ids])
    assert trainer.is_fsdp_enabled
    trainer.train()
    report = callback.report
    assert report is not None and report.trainer_step is not None
    assert report.trainer_step.peak_bytes <= report.budget_bytes
