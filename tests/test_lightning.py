"""RematCallback in a real Lightning fit: plan the LightningModule's training step."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

L = pytest.importorskip("lightning")

from remat.core.errors import RematWarning  # noqa: E402
from remat.integrations.common import IntegrationError  # noqa: E402
from remat.integrations.lightning import RematCallback, lightning_loop  # noqa: E402
from remat.runtime import planned  # noqa: E402

WIDTH = 64


class Net(L.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU())
            for _ in range(4))
        self.head = nn.Linear(WIDTH, 10)
        self.steps_seen = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)  # muted while remat profiles
        return {"loss": loss}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _loader() -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(1024, WIDTH, generator=gen),
                                          torch.randint(0, 10, (1024,), generator=gen))
    return torch.utils.data.DataLoader(data, batch_size=256)


def _trainer(callback: RematCallback, **kw: object) -> L.Trainer:
    return L.Trainer(max_steps=3, accelerator="cpu", devices=1, callbacks=[callback],
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, **kw)


def test_fit_trains_under_the_plan(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    module = Net()
    callback = RematCallback(memory_budget="50%")
    trainer = _trainer(callback, accumulate_grad_batches=2)
    with caplog.at_level(logging.INFO, logger="remat"):
        trainer.fit(module, _loader())
    report = callback.report
    assert trainer.global_step == 3
    assert report is not None and planned(module) == report.plan
    assert report.plan.unit_names == ("layers.0", "layers.1", "layers.2", "layers.3")
    assert report.loop.accumulation_steps == 2 and not report.loop.keep_output
    assert report.predicted_peak_bytes <= report.budget_bytes
    assert report.plan.options != ("keep",) * 4
    step = report.trainer_step
    assert step is not None
    # remat counts one micro-batch on the device (the profile's sample batch); Lightning
    # collates each one inside the step, which comes to the same.
    assert abs(step.peak_bytes - report.predicted_peak_bytes) <= 0.03 * step.peak_bytes
    assert "log" not in vars(module)  # logging un-muted
    print("\n" + report.summary())


def test_a_step_function_replaces_training_step() -> None:
    torch.manual_seed(0)
    module = Net()
    calls: list[int] = []

    def step(mod: Net, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        calls.append(1)
        x, y = batch
        return F.cross_entropy(mod(x), y)

    callback = RematCallback(memory_budget="70%", step=step, measure_step=None, verify=False)
    with warnings.catch_warnings():
        # Lightning zeroes gradients after the forward: the plan's loop says so, and the
        # planned model's loop checks find the loop it was made for.
        warnings.simplefilter("error", RematWarning)
        _trainer(callback).fit(module, _loader())
    assert calls and callback.report is not None and callback.report.trainer_step is None


def test_manual_optimization_is_refused() -> None:
    with pytest.raises(IntegrationError, match="automatic optimization"):
        _trainer(RematCallback(memory_budget="1GB")).fit(Net(manual=True), _loader())


def test_the_loop_follows_precision() -> None:
    trainer = L.Trainer(accelerator="cpu", precision="bf16-mixed", accumulate_grad_batches=3,
                        logger=False)
    loop = lightning_loop(trainer)
    assert (loop.autocast, loop.accumulation_steps, loop.keep_output) == ("bfloat16", 3, False)


def test_the_step_runs_inside_the_wrappers_forward_and_leaves_the_forward_as_it_was() -> None:
    """Under DDPStrategy the callback runs the step inside the wrapper's forward, as
    Lightning's forward redirection does; the module's forward is left as it was, an
    instance ``forward`` someone installed (accelerate, a user patch) included."""
    from remat.integrations.lightning import _redirected

    class Wrapper(nn.Module):
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module
            self.calls = 0

        def forward(self, *inputs):
            self.calls += 1
            return self.module(*inputs)

    def step(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return module(batch).sum()  # the module's own forward, not the redirection

    x = torch.randn(2, 4)
    plain = nn.Linear(4, 3)
    wrapper = Wrapper(plain)
    assert torch.equal(_redirected(wrapper, plain, step, x), plain(x).sum())
    assert wrapper.calls == 1 and "forward" not in vars(plain)

    patched = nn.Linear(4, 3)
    installed = patched.forward  # a bound method, as accelerate installs its wrapper
    patched.forward = installed
    assert torch.equal(_redirected(Wrapper(patched), patched, step, x), patched(x).sum())
    assert vars(patched)["forward"] is installed
