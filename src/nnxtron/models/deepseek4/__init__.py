"""DeepSeek-V4: hyper-connected streams, compressed attention (sliding / CSA / HCA), hash + top-k MoE.

HF ``DeepseekV4ForCausalLM`` (``model_type: deepseek_v4``; transformers 5.24 is the ground
truth). The family, in one place:

* ``block.py``: the layer (``DeepSeek4Block``) and the decoder's stream head;
* ``compressed.py``: the compressed attention (sliding window, CSA with the lightning
  indexer, HCA) and its decoding caches;
* ``mhc.py``: the manifold-constrained hyper-connections;
* ``hf.py``: the HF weight names and ``config.json`` mapping;
* ``maxtext.py``: the MaxText checkpoint names and layouts;
* ``config/deepseek4.py``: its config checks, its layer kinds (``compress_ratios``, the
  hash-routed prefix) and its matmul count — pure rules the config layer runs; its keys
  are the DeepSeek-V4 section of ``config/schema.py``;
* presets: ``config/presets/deepseek4-*.yml``.

Layout (``config/layout.py``): the hash-routed prefix is one ``hash_layers`` block (applied
unrolled), then ``layers`` scans blocks of the period of ``compress_ratios`` (2 for the
release: HCA, CSA) and ``remainder_layers`` holds any leftover.
"""

from __future__ import annotations

from nnxtron.models.deepseek4.block import DeepSeek4Block, stream_head
from nnxtron.models.deepseek4.hf import config_from_hf, config_to_hf, layer_weights, top_weights
from nnxtron.models.deepseek4.maxtext import MAXTEXT
from nnxtron.models.family import Family, Golden, StrategyRow

FAMILIES = (
    Family(
        name="deepseek4",
        hf_model_type="deepseek_v4",
        hf_architecture="DeepseekV4ForCausalLM",
        make_block=DeepSeek4Block,
        layer_weights=layer_weights,
        top_weights=top_weights,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        make_stream_head=stream_head,
        maxtext=MAXTEXT,
        block_takes_tokens=True,
        goldens=(Golden("deepseek4", "deepseek4", fused_checked=True),),
        # hash-routed prefix block + (HCA, CSA) block + HCA remainder, mHC streams, expert loads
        strategy_rows=(StrategyRow("deepseek4-test", True, "full", "data2_fsdp4", 2),),
    ),
)
