"""DeepSeek-V4 starts with docs/init.md's recipe, per tensor (issue 53). The expected statistics
come from the recipes named there, written out below from the config, not from nnxtron's code:

* MaxText 0.2.5's fan-in recipe (``nd_dense_init(1.0, "fan_in", "truncated_normal")``: std
  ``1/sqrt(fan_in)``, the expert and output-group axes counted into the fan-in, as MaxText's own
  ``deepseek4`` decoder draws them) for the embedding, head, attention, compressor, indexer, router
  and expert kernels;
* HF transformers 5.25 ``DeepseekV4PreTrainedModel._init_weights`` (``initializer_range`` 0.02) for
  the hyper-connection mixers (``fn`` normal, ``base`` zeros, ``scale`` ones: HF's parametrisation,
  which MaxText's ``mhc_*`` tensors do not share), attention sinks and compressor position biases
  (zeros);
* ones for norm scales, zeros for the router bias and load counters;
* on purpose unlike both (whose ``tid2eid`` is zeros, every token sent to expert 0 in every slot):
  the hash-routing table of a fresh model holds ``k`` distinct random experts per token id.

Layers of one kind are pooled (every stack's copy of a tensor), so each sample holds >= 1,000 values
but the router's (1,280): its std is within ~2 % of the population's, the mean within 3 %.
Bounds as test_init_parity.py: the std within 10 %, the mean within max(10 %, 4 standard errors) of the std.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import numpy as np
from flax import nnx

from nnxtron.config.loader import load_config
from nnxtron.config.schema import Config
from nnxtron.models.build import build_model
from nnxtron.params import flatten

TOLERANCE = 0.1
HF_INITIALIZER_RANGE = 0.02  # DeepseekV4Config.initializer_range
CONFIG = (  # deepseek4-tiny, 1 hash-routed + 2 x (ratio 4 with indexer, ratio 128) layers, vocab 128, 4 experts
    "model_name=deepseek4-tiny",
    "base_num_decoder_layers=5",
    "compress_ratios=[0,4,128,4,128]",
    "first_num_hash_layers=1",
    "vocab_size=128",
    "num_experts=4",
    "num_experts_per_tok=2",
)
STACK = re.compile(r"^(hash_layers/layers|layers/layers/cycle/\d+|remainder_layers/layers|layers/layers)/")


def _fan_in(fan_in: Callable[[Config], int]) -> Callable[[Config], float]:
    return lambda cfg: 1.0 / math.sqrt(fan_in(cfg))


def _constant(value: float) -> Callable[[Config], float]:
    return lambda cfg: value


# (name pattern, "std" or "constant", value from the config), first match wins
RECIPE: tuple[tuple[str, str, Callable[[Config], float]], ...] = (
    (r"^embed/embedding$", "std", _constant(1.0)),
    (r"^logits/kernel$", "std", _fan_in(lambda c: c.base_emb_dim)),
    (r"(^|/)(norm|\w+_norm)/scale$", "constant", _constant(1.0)),
    (r"_hc/fn$|^hyper_head/fn$", "std", _constant(HF_INITIALIZER_RANGE)),
    (r"_hc/base$|^hyper_head/base$", "constant", _constant(0.0)),
    (r"_hc/scale$|^hyper_head/scale$", "constant", _constant(1.0)),
    (r"attention/sinks$|position_bias$|mlp/router_bias$|mlp/expert_load$", "constant", _constant(0.0)),
    (r"attention/wq_a/kernel$|attention/wkv/kernel$", "std", _fan_in(lambda c: c.base_emb_dim)),
    (r"attention/(indexer/)?wq_b/kernel$", "std", _fan_in(lambda c: c.q_lora_rank)),
    (r"attention/wo_a$", "std", _fan_in(lambda c: c.base_num_query_heads * c.resolved_head_dim)),
    (r"attention/wo_b/kernel$", "std", _fan_in(lambda c: c.o_groups * c.o_lora_rank)),
    (r"compressor/(wkv|wgate)/kernel$|indexer/weights_proj/kernel$", "std", _fan_in(lambda c: c.base_emb_dim)),
    (r"mlp/router/kernel$|mlp/shared/wi_[01]/kernel$", "std", _fan_in(lambda c: c.base_emb_dim)),
    (r"mlp/shared/wo/kernel$", "std", _fan_in(lambda c: c.shared_experts * c.base_moe_mlp_dim)),
    (r"mlp/wi_[01]$", "std", _fan_in(lambda c: c.num_experts * c.base_emb_dim)),
    (r"mlp/wo$", "std", _fan_in(lambda c: c.num_experts * c.base_moe_mlp_dim)),
)


def pooled(cfg: Config) -> dict[str, np.ndarray]:
    """Every initial tensor of a fresh model, the copies of all layers of one kind concatenated."""
    flat = flatten(nnx.to_pure_dict(nnx.state(build_model(cfg))))
    groups: dict[str, list[np.ndarray]] = {}
    for name, value in flat.items():
        groups.setdefault(STACK.sub("", name), []).append(np.asarray(value).ravel())
    return {name: np.concatenate(parts) for name, parts in groups.items()}


def test_deepseek4_starts_with_its_documented_recipe():
    cfg = load_config(None, list(CONFIG))
    tensors = pooled(cfg)
    table = tensors.pop("mlp/tid2eid")
    off = []
    for name, x in sorted(tensors.items()):
        recipe = next(((kind, value) for pattern, kind, value in RECIPE if re.search(pattern, name)), None)
        if recipe is None:
            off.append(f"{name}: no recipe (add it here and to docs/init.md)")
            continue
        kind, expected = recipe[0], recipe[1](cfg)
        if kind == "constant":
            if not np.all(x == expected):
                off.append(f"{name}: values in [{x.min()}, {x.max()}], recipe: all {expected}")
            continue
        mean_tolerance = expected * max(TOLERANCE, 4 / np.sqrt(x.size))
        if abs(x.std() / expected - 1) > TOLERANCE or abs(x.mean()) > mean_tolerance:
            off.append(f"{name}: mean {x.mean():+.4f} std {x.std():.4f}, recipe: mean 0 std {expected:.4f}")
    assert not off, "DeepSeek-V4 tensors that do not start with their recipe:\n" + "\n".join(off)
    # the hash table: k distinct experts per token id, every expert used
    rows = table.reshape(cfg.vocab_size, cfg.num_experts_per_tok)
    assert all(len(set(row)) == cfg.num_experts_per_tok for row in rows.tolist())
    assert set(rows.ravel().tolist()) == set(range(cfg.num_experts))
