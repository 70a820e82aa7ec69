"""Pass 1 of :mod:`.profile` (capture and replays).

``checkpoint``'s backward figures, derived from ``keep``'s instead of metered.

Under ``checkpoint`` a unit's backward is its forward run again with grad (what ``keep``'s
forward does), then ``keep``'s backward on what that recomputation saved. Both halves are
metered already, in keep's replay. So the profiler meters checkpoint's forward alone
(:func:`~remat.profiler.replay.measure_forward`: a forward without grad, holding the
input) and composes the backward, by the rule :func:`remat.solver.simulate` applies to
every multi-unit segment (a one-unit segment is this unit under ``checkpoint``):

* the backward runs until it first unpacks a saved tensor (under autocast it casts the
  output's gradient down first); keep's replay measured what it had made then
  (``recompute_start_bytes``);
* the recomputation runs keep's forward up to its last save, where torch's early stop
  ends it: it peaks at keep's forward peak up to that save (``recompute_peak_bytes``),
  above those bytes and torch's stash of the RNG state and the unit's BatchNorm
  statistics (``stash_bytes``);
* then the stash goes, and keep's backward runs with what keep holds after its forward,
  and the recomputed output where keep holds it: its peak, its peak with each parameter
  gradient freed once complete (a loop stepping in backward), and when each was complete
  are keep's, that much higher.

**Why.** Metering checkpoint's backward replayed the unit once more than anything else
does (a forward without grad, the recomputation, the backward), under the meter and the
allocator's view: 0.8 of a plain step when a CNN of nine distinct blocks is profiled
(issue 31: planning in 10 steps). Its forward alone is a third of that.

**The price, and which way it errs.** Against checkpoint metered in full at the same
call, on the 24 models of ``benchmarks/prediction_accuracy.py`` and
``benchmarks/unseen_models.py`` (2026-11-28): equal on a ResNet, Llama, T5, Qwen2,
Mixtral, OLMoE, ViT, Mamba, DeBERTa and the DenseNets, above by 16 to 1,024 bytes on
GPT-2, BART, Whisper, Gemma 2, a peft LoRA model and ConvNeXt, 3,080 bytes on a Swin
block (0.05% of its forward's peak); never below (``tests/profiler/
test_profiler_recomputed.py`` holds it on the kinds of unit the suite profiles, float16
autocast among them, where leaving out the gradient cast before the recomputation put
the composed peak 1.2% below). What the composition cannot see is whether the
recomputation runs at all: torch refuses one whose tensors differ from the forward's.
Selective checkpointing recomputes through the same machinery, so checkpoint is
composed only on units where selective's replay ran its backward; elsewhere it is
metered in full (:meth:`~remat.profiler.unit_figures.UnitMeasurer._meter`), and so
where keep's replay could not record where a recomputation starts (a unit replayed on a
copy of its input). On a rank of an FSDP2 run, inside FSDP2's window of the unit's
gathered parameters, the composed figures equal the full replay's (2 gloo ranks, the
Llama-style and GPT blocks of ``benchmarks/fsdp.py``, both ``reshard_after_forward``;
``tests/test_fsdp_collective.py`` holds it). A first measurement there had them 3.5 to
13 MB above: replays then left gradients on the gathered parameters, so later replays
added into them in place and the full replay missed their bytes
(:func:`~remat.profiler.replay.clear_replay_grads`).
"""

from __future__ import annotations

from remat.profiler.records import OptionFigures
from remat.profiler.replay import ForwardFigures

__all__ = ["checkpoint_figures"]


def checkpoint_figures(forward: ForwardFigures, keep: OptionFigures, *,
                       stash_bytes: int) -> OptionFigures:
    """``checkpoint``'s figures: its metered ``forward``, and the backward composed of
    ``keep``'s (module docstring); ``stash_bytes`` is what the region holds while it
    recomputes (the RNG state torch forks, the unit's BatchNorm statistics)."""
    if keep.recompute_start_bytes is None or keep.recompute_peak_bytes is None:
        raise ValueError("keep's figures do not say where its backward first unpacked a "
                         "saved tensor and its forward last saved one: meter checkpoint in "
                         "full")
    recompute = keep.recompute_start_bytes + stash_bytes + keep.recompute_peak_bytes
    # What the recomputation leaves for keep's backward, above the backward's start.
    after = keep.held_bytes + (forward.output_bytes if keep.holds_output else 0)
    released = keep.released_bwd_peak_bytes
    return OptionFigures(
        held_bytes=forward.held_bytes,
        holds_input=forward.holds_input,
        holds_output=forward.holds_output,
        fwd_peak_bytes=forward.fwd_peak_bytes,
        bwd_peak_bytes=max(recompute, after + keep.bwd_peak_bytes),
        input_grad_bytes=keep.input_grad_bytes,
        forward_cache_bytes=forward.forward_cache_bytes,
        params_trained=keep.params_trained,
        released_bwd_peak_bytes=None if released is None else max(recompute, after + released),
        grads_ready=tuple((k, after + live) for k, live in keep.grads_ready),
    )
