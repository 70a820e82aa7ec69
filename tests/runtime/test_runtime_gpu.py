"""CUDA-only runtime checks (skipped without a CUDA device)."""

from __future__ import annotations

import pytest
import rt_helpers as h
import torch

from remat.runtime import apply_plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_offload_and_segments_match_reference_on_cuda(name: str) -> None:
    ref = h.build_model(name, device="cuda")
    model = ref.model
    reference = h.twin(model)
    names = h.unit_names(name, model)
    options = dict.fromkeys(names, "offload")
    options[names[0]] = options[names[1]] = "checkpoint"
    plan = h.make_plan(model, names, options, ((0, 1),)).with_target(device="cuda")
    apply_plan(model, plan)
    counters = h.count_first_children(model, names)

    loss = h.train_step(ref, model)
    ref_loss = h.train_step(ref, reference)
    # Close, not bitwise: some CUDA backward kernels (embedding) accumulate atomically.
    torch.testing.assert_close(loss, ref_loss)
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
    assert [c.calls for c in counters] == [2, 2] + [1] * (len(names) - 2)
