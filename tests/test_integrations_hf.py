"""RematCallback in a real transformers Trainer run: solve at train start, apply, measure."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from remat.integrations.common import IntegrationError  # noqa: E402
from remat.integrations.hf import RematCallback  # noqa: E402
from remat.runtime import planned  # noqa: E402

VOCAB, SEQ = 128, 32


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 16) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=3, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                        use_cache=False, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def _args(tmp_path: Path, **kw: object) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4,
                             max_steps=3, report_to=[], save_strategy="no", logging_steps=1,
                             use_cpu=True, disable_tqdm=True, **kw)


def test_trainer_trains_under_the_plan(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = _model()
    callback = RematCallback(memory_budget="50%")
    trainer = Trainer(model=model, args=_args(tmp_path, gradient_accumulation_steps=2),
                      train_dataset=Tokens(), callbacks=[callback])
    with caplog.at_level(logging.INFO, logger="remat"):
        trainer.train()
    report = callback.report
    assert trainer.state.global_step == 3
    assert report is not None and planned(model) == report.plan
    assert report.plan.target.loop is not None and report.plan.target.loop.accumulation_steps == 2
    assert not report.plan.target.loop.keep_output  # the Trainer's loop
    assert report.plan.options != ("keep",) * report.plan.n  # half the activations: it plans
    assert report.predicted_peak_bytes <= report.budget_bytes
    assert report.verified_peak_bytes is not None
    assert report.verified_peak_bytes <= report.budget_bytes
    # The Trainer's own second optimizer step, measured in the run.
    step = report.trainer_step
    assert step is not None and report.measured_at_step == 1
    assert abs(step.peak_bytes - report.predicted_peak_bytes) <= 0.03 * step.peak_bytes
    assert step.peak_bytes <= report.budget_bytes
    assert "measured in the trainer's step 1" in caplog.text
    last = trainer.state.log_history[-1]
    assert last["remat/trainer_peak_bytes"] == step.peak_bytes
    assert last["remat/predicted_peak_bytes"] == report.predicted_peak_bytes
    print("\n" + report.summary())


def _big_vocabulary() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=64, n_head=2, vocab_size=4096,
                                      n_positions=SEQ, use_cache=False, bos_token_id=0,
                                      eos_token_id=0))


def _below_the_head(args: TrainingArguments, data: Tokens) -> int:
    """A budget only a chunked head meets, in the Trainer's loop for ``args``."""
    from remat import Loop, profile
    from remat.solver import min_peak_bytes
    from remat.solver.head_choice import lowest_floor

    probe = _big_vocabulary()
    batch = {"input_ids": data.ids[:4], "labels": data.ids[:4]}
    prof = profile(probe, batch, loop=Loop.hf_trainer(args), repeats=1,
                   optimizer=torch.optim.AdamW(probe.parameters()))
    chunks, lowest = lowest_floor(prof)
    budget = int(lowest * 1.05)
    assert chunks is not None and budget < min_peak_bytes(prof)
    return budget


def _wide_tokens() -> Tokens:
    data = Tokens()
    data.ids = data.ids * 32  # tokens across the whole vocabulary
    return data


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_below_what_the_head_as_it_is_reaches_the_trainer_trains_with_a_chunked_head(
        tmp_path: Path, bf16: bool) -> None:
    args = _args(tmp_path, bf16=bf16)
    data = _wide_tokens()
    budget = _below_the_head(args, data)
    model = _big_vocabulary()
    callback = RematCallback(memory_budget=budget)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    autocast_in_training: list[bool] = []

    def record(_module: object, _args: object) -> None:
        if torch.is_grad_enabled():
            autocast_in_training.append(torch.is_autocast_enabled("cpu"))

    model.transformer.h[0].register_forward_pre_hook(record)
    trainer.train()
    report = callback.report
    assert report is not None and report.plan.head is not None
    assert "smallest peak with the head as written" in report.plan.summary()  # why chunked
    assert report.verified_peak_bytes is not None and report.verified_peak_bytes <= budget
    step = report.trainer_step
    assert step is not None and step.peak_bytes <= budget
    assert abs(step.peak_bytes - report.predicted_peak_bytes) <= 0.01 * step.peak_bytes
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in trainer.state.log_history
               if "loss" in e)
    # accelerate's mixed-precision forward is still the model's: every training forward,
    # planned ones included, ran under its autocast (bf16) or none (float32).
    assert autocast_in_training and all(on == bf16 for on in autocast_in_training)


def _falcon() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.FalconForCausalLM(transformers.FalconConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=VOCAB,
        parallel_attn=True, new_decoder_architecture=False, use_cache=False))


def test_a_model_remat_was_not_written_for_trains_in_bf16_on_the_losses_of_the_unplanned_run(
        tmp_path: Path) -> None:
    # transformers' Falcon (parallel attention: its blocks add into a Linear's output in
    # place, which selective cannot run) in the Trainer with bf16 and 2 micro-batches:
    # the planned run logs the unplanned run's losses, bitwise, step by step.
    losses = []
    reports = []
    for callbacks in ([], [RematCallback(memory_budget="50%")]):
        trainer = Trainer(model=_falcon(), callbacks=callbacks, train_dataset=Tokens(),
                          args=_args(tmp_path, bf16=True, gradient_accumulation_steps=2))
        trainer.train()
        losses.append([e["loss"] for e in trainer.state.log_history if "loss" in e])
        reports.extend(c.report for c in callbacks)
    report = reports[0]
    assert report is not None and "checkpoint" in report.plan.options
    blocks = [o for n, o in zip(report.plan.unit_names, report.plan.options)
              if n.startswith("transformer.h.")]
    assert len(blocks) == 3 and "selective" not in blocks
    assert len(losses[0]) == 3 and losses[1] == losses[0]
    step = report.trainer_step
    assert step is not None and step.peak_bytes <= report.budget_bytes


class _OwnLoss(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        logits = model(**inputs).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                 labels[:, 1:].flatten())


def _smoothed(logits_output, labels, num_items_in_batch=None):
    logits = logits_output.logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                             labels[:, 1:].flatten(), label_smoothing=0.1)


@pytest.mark.parametrize("how", ["label_smoothing_factor", "compute_loss_func", "compute_loss"])
def test_a_trainer_computing_the_loss_outside_the_model_is_planned_as_it_runs(
        tmp_path: Path, how: str) -> None:
    from remat import InfeasibleBudgetError

    kwargs = {"label_smoothing_factor": 0.1} if how == "label_smoothing_factor" else {}
    args = _args(tmp_path, **kwargs)
    data = _wide_tokens()
    make = _OwnLoss if how == "compute_loss" else Trainer
    extra = {"compute_loss_func": _smoothed} if how == "compute_loss_func" else {}
    # Below the head as written, the model's own loss could chunk it; this Trainer's loss
    # reads the logits, so no plan fits (before: a chunked head planned, bypassed, and the
    # step 80-104% over the budget).
    below = _below_the_head(_args(tmp_path), data)
    trainer = make(model=_big_vocabulary(), args=args, train_dataset=data,
                   callbacks=[RematCallback(memory_budget=below)], **extra)
    with pytest.raises(InfeasibleBudgetError):
        trainer.train()
    model = _model()
    callback = RematCallback(memory_budget="50%")
    trainer = make(model=model, args=args, train_dataset=Tokens(), callbacks=[callback],
                   **extra)
    trainer.train()
    report = callback.report
    assert report is not None and report.plan.head is None
    assert planned(model) == report.plan and report.plan.options != ("keep",) * report.plan.n
    step = report.trainer_step
    assert step is not None and step.peak_bytes <= report.budget_bytes
    assert abs(step.peak_bytes - report.predicted_peak_bytes) <= 0.03 * step.peak_bytes


def test_hf_gradient_checkpointing_is_refused(tmp_path: Path) -> None:
    with pytest.raises(IntegrationError, match="recomputed twice"):
        Trainer(model=_model(), args=_args(tmp_path, gradient_checkpointing=True),
                train_dataset=Tokens(), callbacks=[RematCallback(memory_budget="1GB")])


def test_model_checkpointing_turned_on_later_is_refused(tmp_path: Path) -> None:
    model = _model()
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=Tokens(),
                      callbacks=[RematCallback(memory_budget="1GB")])
    model.gradient_checkpointing_enable()
    with pytest.raises(IntegrationError, match="gradient_checkpointing"):
        trainer.train()


def _tiny_mixtral() -> torch.nn.Module:
    """A 2-layer ``transformers`` Mixtral in train mode, seed 0, its router's loss on."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.02, use_cache=False)
    return transformers.MixtralForCausalLM(config).train()


def test_a_mixtral_trains_bitwise_as_before_after_solve() -> None:
    # transformers installs its output-capturing hooks on a model's first call and marks
    # that with an attribute: solve() put back the mark but not the hooks, so the next
    # call hooked every router again and captured its logits more than once (on a larger
    # Mixtral the load-balancing loss moved and every gradient differed, no plan applied).
    import copy

    import remat

    model = _tiny_mixtral()
    config = model.config
    untouched = copy.deepcopy(model)
    ids = torch.randint(0, 512, (2, 32))
    remat.solve(model, {"input_ids": ids, "labels": ids}, memory_budget=None)
    for m in (model, untouched):
        out = m(input_ids=ids, labels=ids)
        assert len(out.router_logits) == config.num_hidden_layers  # each router's, once
        out.loss.backward()
    for (name, p), q in zip(model.named_parameters(), untouched.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_the_profilers_replays_add_nothing_to_the_forwards_captured_outputs() -> None:
    # The profiler replays each unit inside the model's own forward (the capture pass).
    # transformers' output-capturing hooks appended each replay's router logits to that
    # forward's collector, with their graphs: what the replays saved stayed alive unit
    # after unit (on fsdp_unseen's Mixtral, enough to run profiling out of a device of the
    # floor budget), and the forward's output carried the replays' logits
    # (remat.execute.output_capture).

    import remat

    model = _tiny_mixtral()
    config = model.config
    ids = torch.randint(0, 512, (2, 32))
    captured: list[int] = []

    def loss_fn(output, batch):  # noqa: ANN001, ANN202
        captured.append(len(output.router_logits))
        return output.loss

    remat.profile(model, {"input_ids": ids, "labels": ids}, loss_fn=loss_fn)
    assert captured and set(captured) == {config.num_hidden_layers}, captured


def test_a_pass_out_of_memory_after_the_heads_check_did_not_fit_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Where the model head's check (one example's step as written) did not fit, the
    # passes after it compute the head as written: running out of memory there is no
    # proof that no plan fits (a plan with the head chunked may), which the error had said
    # (a LoRA Qwen2 under DDP at its floor, benchmarks/fsdp_in_device.py).
    import importlib

    import transformers

    import remat
    import remat.profiler.heads as heads

    profile_module = importlib.import_module("remat.profiler.profile")  # not the function

    def too_big(*_: object) -> None:
        raise torch.OutOfMemoryError("simulated device out of memory: test")

    monkeypatch.setattr(heads, "check_head_rewrite", too_big)
    monkeypatch.setattr(profile_module, "record_saves", too_big)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, vocab_size=512, use_cache=False)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 512, (2, 32))
    with pytest.raises(remat.DeviceMemoryError, match="head was not offered chunked"):
        remat.profile(model, {"input_ids": ids, "labels": ids},
                      loop=remat.Loop(keep_output=False))


def test_what_the_layers_record_for_the_loss_is_counted_held() -> None:
    # The router logits transformers' collector keeps from each layer's forward to the
    # loss are made where the units run for real (the replays record nothing): counted
    # held through the step. Left out, a DDP Mixtral's plan with a segment of three
    # layers measured two layers' logits (16 KiB) above its prediction.

    import remat

    model = _tiny_mixtral()
    config = model.config
    ids = torch.randint(0, 512, (2, 32))
    batch = {"input_ids": ids, "labels": ids}
    recording = remat.profile(model, batch)
    model.config.output_router_logits = False
    silent = remat.profile(model, batch)
    logits = config.num_hidden_layers * ids.numel() * config.num_local_experts * 4  # fp32
    assert recording.prefix.held_bytes - silent.prefix.held_bytes == logits
