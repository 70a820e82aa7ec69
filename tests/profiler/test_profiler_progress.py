"""The progress line: on a terminal only, never with progress=False, never via print."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from remat.profiler import profile
from remat.profiler.progress import Progress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("enabled", [None, True])
def test_shown_on_a_terminal(enabled: bool | None) -> None:
    out = FakeTerminal()
    bar = Progress(3, enabled, stream=out)
    bar.step("capture")
    bar.step("unit blocks.0")
    bar.close()
    text = out.getvalue()
    assert "remat: profiling [1/3] capture" in text
    assert "[2/3] unit blocks.0" in text
    assert text.endswith("\n")


def test_quiet_when_disabled_or_not_a_terminal() -> None:
    for stream, enabled in ((FakeTerminal(), False), (io.StringIO(), True), (io.StringIO(), None)):
        bar = Progress(2, enabled, stream=stream)
        bar.step("capture")
        bar.close()
        assert stream.getvalue() == ""


def test_profile_writes_nothing_when_not_on_a_terminal(capsys) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    profile(model, torch.randn(2, 4), loss_fn=lambda o, b: o.sum(), repeats=1, warmup=0,
            progress=True)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
