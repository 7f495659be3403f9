"""Adversarial variants of every golden case (``<out>/adversarial/<case>/``, ``--adversarial``).

The plain goldens use the scale of a fresh random init and the configs' usual values, where
some mistakes hide: an epsilon that is not read (the plain configs use the defaults), a 1-D
parameter read as its init value, a window that divides the sequence. Each variant keeps its
case's architecture and changes, on top of the plain init:

* a new model seed (``seed + SEED_OFFSET``);
* every parameter of two or more dimensions multiplied by a factor drawn per tensor from
  ``WEIGHT_SCALE`` (x2-3);
* every 1-D parameter (norm scales, biases, sinks, router biases) plus ``VECTOR_STD * randn``;
* the correction biases (``e_score_correction_bias``) redrawn at ``TABLE_SCALE`` and the hash
  table (``tid2eid``) redrawn;
* ``rms_norm_eps`` / ``layer_norm_epsilon`` = ``EPS`` and ``hc_eps`` = ``HC_EPS`` (not the defaults);
* an odd sequence length (``SEQ_LEN``, or the case's ``adversarial_seq_len``: deepseek4's 157) and
  windows that do not divide it (``WINDOWS``, or the case's ``adversarial_window``).

At this scale float32 rounding moves HF's own logits by up to 2.3e-6 (gemma3) from the same
model run in float64, so ``golden.safetensors`` also holds ``logits_float64`` (HF, float64,
same weights), the reference of the adversarial parity test.

Each variant runs its case's near-tie refusals (``Case.tie_checks``, in the family's module):
every top-k choice (MoE routers, group limit, indexer) must have a gap above ``MIN_ROUTING_GAP``
(indexer: 1e-6) between the k-th and the (k+1)-th score, or the script stops. Nothing here names
a family: what differs per case is on its ``Case``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from goldens.harness import Case, Run, redraw_hash_table, write_golden

SEED_OFFSET = 100
PERTURB_SEED = 2929
WEIGHT_SCALE = (2.0, 3.0)
VECTOR_STD = 0.3
TABLE_SCALE = 0.2
EPS = 3e-4
HC_EPS = 1e-3
SEQ_LEN = 37
WINDOWS = {"sliding_window": 5, "attention_chunk_size": 5}


@torch.no_grad()
def perturb(model: torch.nn.Module) -> None:
    """Scale the matrices, shift the vectors, redraw the non-trainable tables (one generator, fixed order)."""
    gen = torch.Generator().manual_seed(PERTURB_SEED)
    low, high = WEIGHT_SCALE
    for _, p in model.named_parameters():
        if p.ndim >= 2:
            p.mul_(low + (high - low) * float(torch.rand((), generator=gen)))
        else:
            p.add_(VECTOR_STD * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(TABLE_SCALE * torch.randn(b.shape, generator=gen, dtype=b.dtype))
        elif name.endswith("tid2eid"):  # [V, k] token -> k distinct experts
            redraw_hash_table(b, model.config.n_routed_experts, gen)


@torch.no_grad()
def float64_reference(run: Run) -> None:
    """Add HF's logits of the same model run in float64 to ``golden.safetensors``."""
    model = copy.deepcopy(run.model).to(torch.float64)
    exact = model(input_ids=run.input_ids.long(), use_cache=False).logits
    print(f"  max|float32 logits - float64 logits| (HF) = {float((run.logits.double() - exact).abs().max()):.3e}")
    write_golden(run.dir / "golden.safetensors", run.input_ids, run.logits, logits_float64=exact)


def _kwargs(case: Case) -> dict[str, Any]:
    kwargs = dict(case.kwargs)
    for key in ("rms_norm_eps", "layer_norm_epsilon"):
        if key in kwargs:
            kwargs[key] = EPS
    if "hc_eps" in kwargs:
        kwargs["hc_eps"] = HC_EPS
    for key, window in WINDOWS.items():
        if kwargs.get(key):
            kwargs[key] = case.adversarial_window or window
    return kwargs


def adversarial(case: Case) -> Case:
    """The adversarial variant of ``case`` (same name; written under ``adversarial/``)."""
    assert not case.routed or case.tie_checks, f"{case.name}: a case with routed experts needs its near-tie refusal (tie_checks)"
    return dataclasses.replace(
        case,
        kwargs=_kwargs(case),
        checks=(*case.tie_checks, float64_reference),
        seed=case.seed + SEED_OFFSET,
        seq_len=case.adversarial_seq_len or SEQ_LEN,
        perturb=perturb,
        versions={},
    )


def settings(cases: Iterable[Case]) -> dict[str, Any]:
    """The adversarial settings of ``cases`` (the plain ones), for ``adversarial/versions.json``."""
    cases = tuple(cases)
    windows = {
        f"{c.name}_{key}": c.adversarial_window for c in cases if c.adversarial_window for key in WINDOWS if c.kwargs.get(key)
    }
    return {
        "seed_offset": SEED_OFFSET,
        "perturb_seed": PERTURB_SEED,
        "weight_scale": list(WEIGHT_SCALE),
        "vector_std": VECTOR_STD,
        "table_scale": TABLE_SCALE,
        "eps": EPS,
        "hc_eps": HC_EPS,
        "seq_len": SEQ_LEN,
        **{f"{c.name}_seq_len": c.adversarial_seq_len for c in cases if c.adversarial_seq_len},
        "windows": dict(WINDOWS, **windows),
    }
