"""The decoder: embed -> layer stack -> final norm -> logits."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from nnxtron.config.schema import Config
from nnxtron.layers.embed import Embed
from nnxtron.layers.linear import Linear
from nnxtron.layers.norms import RMSNorm
from nnxtron.models.registry import family_for
from nnxtron.parallel.remat import RematSpec
from nnxtron.parallel.scan import LayerStack
from nnxtron.parallel.sharding import constrain


@struct.dataclass
class DecoderOutput:
    """What a model call returns: float32 logits plus explicit auxiliary outputs."""

    logits: jax.Array  # [B, S, V] float32
    aux: dict[str, Any] = struct.field(default_factory=dict)


class Decoder(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        family = family_for(cfg.decoder_block)
        dtype, weight_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
        k_embed, k_layers, k_head = jax.random.split(rngs.params(), 3)
        self.embed = Embed(cfg.vocab_size, cfg.base_emb_dim, dtype=dtype, weight_dtype=weight_dtype, rngs=nnx.Rngs(k_embed))
        self.layers = LayerStack(
            lambda r: family.make_block(cfg, r),
            cfg.base_num_decoder_layers,
            key=k_layers,
            scan=cfg.scan_layers,
            remat=RematSpec.from_config(cfg),
        )
        self.final_norm = RMSNorm(cfg.base_emb_dim, eps=cfg.normalization_layer_epsilon, dtype=dtype, weight_dtype=weight_dtype)
        if not cfg.logits_via_embedding:
            self.logits = Linear(
                [cfg.base_emb_dim],
                [cfg.vocab_size],
                ("embed", "vocab"),
                dtype=dtype,
                weight_dtype=weight_dtype,
                rngs=nnx.Rngs(k_head),
            )
        self.config = cfg  # static (hashable) metadata: HF export and checkpoints read it
        self.tied = cfg.logits_via_embedding
        self.soft_cap = cfg.final_logits_soft_cap

    def __call__(
        self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
    ) -> DecoderOutput:
        """tokens [B, S] int; positions default to 0..S-1; segment_ids default to one segment."""
        return self.from_embeddings(self.embed(tokens), positions, segment_ids)

    def from_embeddings(
        self, x: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
    ) -> DecoderOutput:
        """Everything after the embedding lookup (x [B, S, D]); lets tests take the input cotangent."""
        shape = x.shape[:2]
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(shape[1], dtype=jnp.int32), shape)
        if segment_ids is None:
            segment_ids = jnp.ones(shape, jnp.int32)
        x = constrain(x, ("activation_batch", "activation_length", "activation_embed"))
        x = self.layers(x, positions, segment_ids)
        x = self.final_norm(x)
        logits = self.embed.attend(x) if self.tied else self.logits(x)
        logits = logits.astype(jnp.float32)
        if self.soft_cap > 0:
            logits = self.soft_cap * jnp.tanh(logits / self.soft_cap)
        logits = constrain(logits, ("activation_batch", "activation_length", "activation_vocab"))
        return DecoderOutput(logits=logits)


def build_model(cfg: Config, seed: int | None = None) -> Decoder:
    """Construct a Decoder eagerly (unsharded); see train.state for sharded creation."""
    with nnx.use_eager_sharding(False):
        return Decoder(cfg, nnx.Rngs(cfg.init_weights_seed if seed is None else seed))


def abstract_model(cfg: Config) -> Decoder:
    """The Decoder with ShapeDtypeStruct leaves: shapes, dtypes and metadata, no arrays."""
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(cfg.init_weights_seed)))
