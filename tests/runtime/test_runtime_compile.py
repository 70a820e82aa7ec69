"""A planned model under torch.compile: options traced, segments run eagerly."""

from __future__ import annotations

import pytest
import rt_helpers as h
import torch

from remat.runtime import apply_plan


@pytest.mark.slow
def test_compiled_planned_mlp_matches_eager() -> None:
    ref = h.build_model("mlp")
    model = ref.model
    reference = h.twin(model)
    names = h.unit_names("mlp", model)
    options = {names[0]: "checkpoint", names[1]: "checkpoint", names[2]: "checkpoint",
               names[3]: "selective", names[4]: "keep", names[5]: "checkpoint"}
    apply_plan(model, h.make_plan(model, names, options, ((0, 1),)))
    counters = h.count_first_children(model, names)
    compiled = torch.compile(model)  # default backend (inductor)

    for step in range(2):
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        loss = h.train_step(ref, compiled, seed=step)
        ref_loss = h.train_step(ref, reference, seed=step)
        torch.testing.assert_close(loss, ref_loss)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    # The segment's units ran eagerly in forward and in recomputation; inside the
    # compiled units the hooks are traced, so they are not counted.
    assert [c.calls for c in counters[:2]] == [4, 4]


@pytest.mark.slow
def test_compiled_batchnorm_cnn_updates_statistics_once() -> None:
    """Under torch.compile the graph recomputes; running statistics still update once."""
    ref = h.build_model("cnn")
    model = ref.model
    reference = h.twin(model)
    names = h.unit_names("cnn", model)
    options = dict.fromkeys(names, "checkpoint")
    options[names[-1]] = "selective"
    apply_plan(model, h.make_plan(model, names, options))
    compiled = torch.compile(model, backend="aot_eager")  # inductor is covered above
    for step in range(2):
        h.train_step(ref, compiled, seed=step)
        h.train_step(ref, reference, seed=step)
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, msg=name)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
