"""The decoder returns its blocks' auxiliary losses explicitly: the MoE load-balance loss
of every MoE layer, summed over the layers of both stacks, equally when scanned."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnxtron.config.stacks import layer_stacks
from nnxtron.models.build import build_model
from tests.conftest import random_batch, tiny_config

WEIGHT = 0.05


def _aux(scan: bool) -> tuple[float, float]:
    cfg = tiny_config("deepseek3-test", load_balance_loss_weight=WEIGHT, scan_layers=scan)
    model = build_model(cfg)
    batch = {k: jnp.asarray(v) for k, v in random_batch(cfg, batch=2, seq=8).items()}

    @nnx.jit
    def run(model, batch):
        out = model(batch["inputs"], batch["positions"], batch["segment_ids"])
        if scan:
            return out.aux["losses"]["moe_lb_loss"], jnp.zeros(())
        # by hand: every layer of every stack in order, collecting what each block returns
        x, total = model.embed(batch["inputs"]), jnp.zeros(())
        for name in model.stack_names:
            for layer in getattr(model, name).layers:
                y = layer(x, batch["positions"], batch["segment_ids"])
                x, aux = y if isinstance(y, tuple) else (y, {})
                total = total + aux.get("moe_lb_loss", 0.0)
        return out.aux["losses"]["moe_lb_loss"], total

    decoder, by_hand = run(model, batch)
    return float(decoder), float(by_hand)


def test_load_balance_loss_is_the_sum_over_moe_layers_and_scan_agrees():
    unrolled, by_hand = _aux(scan=False)
    scanned, _ = _aux(scan=True)
    moe_layers = layer_stacks(tiny_config("deepseek3-test"))[-1].num_layers
    assert moe_layers == 2
    # each layer's E * sum f_e P_e is >= 1 (equality at perfect balance), times the weight
    assert unrolled >= moe_layers * WEIGHT * 0.999
    np.testing.assert_allclose(unrolled, by_hand, rtol=1e-6)
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-5)
