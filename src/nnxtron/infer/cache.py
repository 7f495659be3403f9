"""Decoding caches for a whole model: one ``TokenCache`` (``layers/kv_cache.py``) per
attention layer of every layer stack."""

from __future__ import annotations

from flax import nnx

from nnxtron.config.families import check_decodes
from nnxtron.errors import ConfigError
from nnxtron.layers.kv_cache import CacheSpec, TokenCache
from nnxtron.layers.paged_cache import PagedCache


def attach_caches(model: nnx.Module, batch: int, max_length: int, paging=None) -> None:
    """Give every attention layer of ``model``'s layer stacks a cache for ``batch`` rows of
    up to ``max_length`` tokens (modules with a ``cache_spec(max_length)`` method returning
    one ``CacheSpec`` or a dict of them). With ``paging`` (``infer.paging.Paging``; unrolled
    layers only) the caches are ``PagedCache`` block pools shared by all sequences."""
    check_decodes(model.config)  # first: a family with attention layers may still not decode (Qwen3-Next)
    targets = []
    for name in model.stack_names:
        stack = getattr(model, name)
        if stack.scan:
            blocks, lead, lead_axes = [stack.layers], (stack.num_layers,), (stack.axis_name,)
        else:
            blocks, lead, lead_axes = list(stack.layers), (), ()
        for block in blocks:
            for _, module in nnx.iter_modules(block):
                if hasattr(module, "cache_spec"):
                    targets.append((module, lead, lead_axes))
    if not targets:
        raise RuntimeError(f"{model.config.decoder_block}: the family's rules say it decodes, but no layer has a cache_spec")

    def make(spec: CacheSpec, lead, lead_axes) -> TokenCache:
        if paging is None:
            return TokenCache(batch, spec, lead, lead_axes)
        if lead:
            raise ValueError("paged caches need unrolled layers (infer.decode.unrolled)")
        if not spec.pageable:
            raise ConfigError(
                f"decoder_block={model.config.decoder_block}: its recurrent decoding state cannot live in paged caches; "
                "decode it without paging (nnxtron generate)"
            )
        return PagedCache(batch, spec, paging.block_size, paging.pool_blocks(spec.size, max_length))

    with nnx.use_eager_sharding(False):  # annotations only; the arrays are placed by whoever jits the step
        for module, lead, lead_axes in targets:
            spec = module.cache_spec(max_length)
            if isinstance(spec, CacheSpec):
                module.cache = make(spec, lead, lead_axes)
            else:  # several caches (DeepSeek-V4: sliding keys, compressor buffers and entries)
                module.cache = nnx.Dict({name: make(one, lead, lead_axes) for name, one in spec.items()})
