"""How far a chunked head's loss and gradients are from the unchunked model's.

A Hugging Face GPT-2 (3 layers, width 64, vocabulary 4096, tied input/output embedding,
batch 4 x 64, random weights, the model's own loss on ``labels``) is trained one step as
it is and with its head over each chunk count (:mod:`remat.execute.head`), in float32
and under bfloat16 autocast; the table gives the loss's absolute difference and, over
every parameter's gradient, the largest absolute difference and the largest difference
relative to that gradient's largest entry. CPU, deterministic.

Prints a markdown table and writes it to benchmarks/results/head_numerics.md.

    .venv/bin/python benchmarks/head_numerics.py
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import logging
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see peers.py

import torch  # noqa: E402
from _common import RESULTS, machine_line, markdown_table, write_result  # noqa: E402
from torch import nn  # noqa: E402

from remat.execute import HeadSite, install_head, remove_head  # noqa: E402

log = logging.getLogger("head_numerics")
SITE = HeadSite("lm_head", "causal-lm")


def gpt2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=4096, n_positions=64,
                        use_cache=False, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 4096, (4, 64))
    return model, {"input_ids": ids, "labels": ids}


def step(model: nn.Module, batch: dict[str, torch.Tensor], autocast: bool,
         chunks: int | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    if chunks is not None:
        install_head(model, SITE, chunks)
    context = (torch.autocast("cpu", dtype=torch.bfloat16) if autocast
               else contextlib.nullcontext())
    try:
        torch.manual_seed(1)  # the same dropout masks
        with context:
            loss = model(**batch).loss
        loss.backward()
    finally:
        if chunks is not None:
            remove_head(model, SITE)
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model, batch = gpt2()
    rows = []
    for autocast in (False, True):
        plain_loss, plain_grads = step(copy.deepcopy(model), batch, autocast, None)
        for chunks in (4, 16, 64):
            loss, grads = step(copy.deepcopy(model), batch, autocast, chunks)
            largest = max((g - w).abs().max().item() for g, w in zip(grads, plain_grads))
            relative = max(((g - w).abs().max() / w.abs().max()).item()
                           for g, w in zip(grads, plain_grads))
            rows.append(["bfloat16 autocast" if autocast else "float32", chunks,
                         f"{(loss - plain_loss).abs().item():.3g}", f"{largest:.3g}",
                         f"{relative:.3g}"])
    lines = [
        "# A chunked head's loss and gradients against the unchunked model's", "",
        f"{dt.date.today()}, {machine_line(torch.get_num_threads())}; Hugging Face GPT-2 "
        "(3 layers, width 64, vocabulary 4096, tied embedding), batch 4 x 64, one step.", "",
        "    .venv/bin/python benchmarks/head_numerics.py", "",
        *markdown_table(["precision", "chunks", "loss, abs. difference", "gradients, largest abs. "
                         "difference", "the same / that gradient's largest entry"], rows,
                        ["---", "---:", "---:", "---:", "---:"]),
        "",
    ]
    text = "\n".join(lines)
    write_result(RESULTS / "head_numerics.md", text)


if __name__ == "__main__":
    main()
