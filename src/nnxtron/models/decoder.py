"""The decoder: embed -> layer stacks -> final norm -> logits (+ multi-token prediction).

The layer stacks come from ``config.stacks.built_stacks``: one ``layers`` stack; for MoE
models with a dense prefix ``dense_layers`` then ``moe_layers``; for layer patterns
(Gemma 3, Llama 4) ``layers`` of whole cycles then ``remainder_layers`` — each scanned
with its own stack axis name, or run as a pipeline (``parallel.pipeline``). Token embeddings are scaled by ``sqrt(emb_dim)`` for
families that do (Gemma) and learned position embeddings are added when
``trainable_position_size`` > 0 (GPT-3). Auxiliary outputs are explicit: ``DecoderOutput.aux``
holds ``"losses"`` (already weighted, added to the training objective by the step:
MoE load balancing, MTP) and diagnostics such as ``"mtp_loss"`` and
``"mtp_acceptance"``.

Dropout (``layers.dropout``, training only: the step passes per-row ``dropout_keys``) acts
where MaxText's does: on the token embeddings before position embeddings are added, inside
each layer (its blocks' own sites) and on the final-normed hidden states before the head.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from nnxtron.config.layout import LayerKind
from nnxtron.config.pipeline import pipeline_spec
from nnxtron.config.schema import Config
from nnxtron.config.stacks import built_stacks
from nnxtron.layers import dropout
from nnxtron.layers.embed import Embed, table_stddev, tied_logit_scale
from nnxtron.layers.linear import Linear
from nnxtron.layers.lora import building as building_lora
from nnxtron.layers.lora import select_targets as select_lora_targets
from nnxtron.layers.lora import settings_of as lora_settings
from nnxtron.layers.matmul import plain_products
from nnxtron.models.mtp import MultiTokenPrediction
from nnxtron.models.registry import family_for
from nnxtron.models.stack import make_stack_block
from nnxtron.parallel.pipeline import PipelinedStack
from nnxtron.parallel.remat import RematSpec
from nnxtron.parallel.row_keys import fold
from nnxtron.parallel.scan import LayerStack, sum_aux
from nnxtron.parallel.sharding import RESIDUAL, constrain


@struct.dataclass
class DecoderOutput:
    """What a model call returns: float32 logits plus explicit auxiliary outputs."""

    logits: jax.Array  # [B, S, V] float32
    aux: dict[str, Any] = struct.field(default_factory=dict)


def matmul_precision(call: Callable[..., Any]) -> Callable[..., Any]:
    """Trace ``call`` under ``jax.default_matmul_precision(self.config.matmul_precision)``: every
    matmul of the model (and, through the transpose rules, of its gradient) records that
    precision; ``default`` leaves JAX's own default. The optimizer's matmuls are outside."""

    @functools.wraps(call)
    def traced(self, *args: Any, **kwargs: Any) -> Any:
        if self.config.matmul_precision == "default":
            return call(self, *args, **kwargs)
        with jax.default_matmul_precision(self.config.matmul_precision):
            return call(self, *args, **kwargs)

    return traced


class Decoder(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        lora = lora_settings(cfg)
        with building_lora(lora):  # every Linear gets adapters; those not targeted are removed next
            self._build(cfg, rngs)
        select_lora_targets(self, lora, (*self.stack_names, "mtp"))

    def _build(self, cfg: Config, rngs: nnx.Rngs) -> None:
        family = family_for(cfg.decoder_block)
        dtype, weight_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
        k_embed, k_layers, k_head = jax.random.split(rngs.params(), 3)
        self.embed_scale = cfg.base_emb_dim**0.5 if family.scale_embeddings else 0.0
        tied, normalize = cfg.logits_via_embedding, cfg.normalize_embedding_logits
        self.embed = Embed(
            cfg.vocab_size,
            cfg.base_emb_dim,
            dtype=dtype,
            weight_dtype=weight_dtype,
            rngs=nnx.Rngs(k_embed),
            stddev=table_stddev(cfg.base_emb_dim, self.embed_scale, tied, normalize),  # tied: unit-scale logits
        )
        if cfg.trainable_position_size:
            self.position_embed = Embed(
                cfg.trainable_position_size,
                cfg.base_emb_dim,
                dtype=dtype,
                weight_dtype=weight_dtype,
                rngs=nnx.Rngs(jax.random.fold_in(k_embed, 1)),
                axes=(None, "embed"),
            )
        if family.make_stream_head is not None:  # the residual is several streams (hyper-connections)
            self.hyper_head = family.make_stream_head(cfg, nnx.Rngs(jax.random.fold_in(k_head, 2)))
        self.takes_tokens = family.block_takes_tokens
        stacks = built_stacks(cfg)

        def make_layer(r: nnx.Rngs, kind: LayerKind) -> nnx.Module:
            return family.make_block(cfg, r, kind)

        pipeline = pipeline_spec(cfg)
        remat = RematSpec.from_config(cfg)
        for built in stacks:
            layout = built.layout
            # keyed by the unsplit stack, so a partial pipeline (``unpipelined_layers``) builds
            # the same weights as the unsplit stack
            key = k_layers if built.pattern_index == 0 else jax.random.fold_in(k_layers, built.pattern_index)
            block = make_stack_block(make_layer, layout)
            if pipeline is not None and layout.name == pipeline.stack:
                stack = PipelinedStack(
                    block,
                    layout.num_layers,
                    key=key,
                    remat=remat,
                    axis_name=layout.name,
                    pipeline=pipeline,
                    unroll=not cfg.scan_layers,
                    global_layers=layout.global_layers,
                )
            else:
                stack = LayerStack(
                    block,
                    layout.num_layers,
                    key=key,
                    scan=cfg.stacked_layers,
                    remat=remat,
                    axis_name=layout.name,
                    first_block=built.first_block,
                    unroll=not cfg.scan_layers,
                    global_layers=layout.global_layers,
                )
            setattr(self, layout.name, stack)
        self.stack_names = tuple(built.layout.name for built in stacks)
        self.stack_patterns = tuple(built.pattern_index for built in stacks)
        if cfg.mtp_num_layers:  # MTP blocks are of the last layer's kind
            last_kind = stacks[-1].layout.kinds[-1]
            if stacks[-1].layout.global_layers:  # a stack of ``selected`` blocks: the last layer's own kind
                last_kind = dataclasses.replace(
                    last_kind, attention="global" if stacks[-1].layout.global_layers[-1] else "sliding"
                )
            self.mtp = MultiTokenPrediction(cfg, lambda r: family.make_block(cfg, r, last_kind), jax.random.fold_in(k_head, 1))
        self.final_norm = family.make_final_norm(cfg)
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
        # the tied head x @ (E * scale)^T / divisor: MaxText's, normalize_embedding_logits included
        self.tied_scale = tied_logit_scale(cfg.base_emb_dim, self.embed_scale, cfg.normalize_embedding_logits)
        self.soft_cap = cfg.final_logits_soft_cap

    @matmul_precision
    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        targets: jax.Array | None = None,
        loss_mask: jax.Array | None = None,
        dropout_keys: dropout.Keys | None = None,
    ) -> DecoderOutput:
        """tokens [B, S] int; positions default to 0..S-1; segment_ids default to one segment.

        ``targets`` (and ``loss_mask``) are only needed by multi-token prediction, whose
        losses are computed when targets are given. ``dropout_keys`` [B]: per-row PRNG keys
        (``parallel.row_keys``) to train with dropout; None (eval, generation) drops nothing.
        """
        # qwix's quantized matmuls intercept dot_general itself: no float32-product path under them
        with plain_products(self.config.use_qwix_quantization):
            return self.forward(tokens, positions, segment_ids, targets, loss_mask, dropout_keys)

    def forward(
        self,
        tokens: jax.Array,
        positions: jax.Array | None,
        segment_ids: jax.Array | None,
        targets: jax.Array | None,
        loss_mask: jax.Array | None,
        dropout_keys: dropout.Keys | None,
    ) -> DecoderOutput:
        """``__call__``'s body (see there)."""
        shape = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(shape[1], dtype=jnp.int32), shape)
        if segment_ids is None:
            segment_ids = jnp.ones(shape, jnp.int32)
        if self.config.dropout_rate == 0.0 and not self.config.lora_dropout:  # nothing drops: no random ops
            dropout_keys = None
        x = self.embed_scale_and_positions(self.embed(tokens), positions, dropout_keys)
        embedded = x = constrain(x, RESIDUAL)
        args = (positions, segment_ids, tokens) if self.takes_tokens else (positions, segment_ids)
        if hasattr(self, "hyper_head"):  # k copies of the residual stream
            x = self.hyper_head.expand(x)
        stack_aux = []
        for name, pattern_index in zip(self.stack_names, self.stack_patterns, strict=True):
            if dropout_keys is None:
                x, aux = getattr(self, name)(x, *args)
            else:  # a stack's keys depend on the unsplit stack it comes from, not on the split
                x, aux = getattr(self, name)(x, *args, dropout_keys=fold(dropout_keys, dropout.STACKS + pattern_index))
            stack_aux.append(aux)
        if hasattr(self, "hyper_head"):
            x = self.hyper_head(x)
        logits = self.head(x, dropout_keys)
        out_aux: dict[str, Any] = {"losses": sum_aux(*stack_aux)}
        if self.config.mtp_num_layers and targets is not None:
            mtp_keys = fold(dropout_keys, dropout.MTP)
            if mtp_keys is not None:  # MaxText's MTP embeds the tokens ahead anew (its own dropout masks)
                embedded = constrain(self.embed_scale_and_positions(self.embed(tokens), positions), RESIDUAL)
            mtp = self.mtp(x, embedded, self.output_head, logits, targets, positions, segment_ids, loss_mask, mtp_keys)
            out_aux["losses"] = sum_aux(out_aux["losses"], mtp.pop("losses"))
            out_aux.update(mtp)
        if not out_aux["losses"]:
            del out_aux["losses"]
        return DecoderOutput(logits=logits, aux=out_aux)

    def embed_scale_and_positions(
        self, x: jax.Array, positions: jax.Array, dropout_keys: dropout.Keys | None = None
    ) -> jax.Array:
        """Token embeddings -> decoder input: the Gemma ``sqrt(emb_dim)`` scale (HF rounds it to
        the table's dtype first), dropout (training) and learned position embeddings (GPT-3)."""
        if self.embed_scale:
            x = x * jnp.asarray(self.embed_scale, self.embed.embedding.dtype).astype(x.dtype)
        x = dropout.dropout(x, dropout_keys, self.config.dropout_rate, dropout.EMBED)
        if hasattr(self, "position_embed"):
            x = x + self.position_embed(positions)
        return x

    def head(self, x: jax.Array, dropout_keys: dropout.Keys | None = None) -> jax.Array:
        """Final norm (then dropout, training) and output head: hidden states [B, S, D] ->
        float32 logits [B, S, V]."""
        # the residual stream's batch sharding: a pipeline's output is replicated over `stage`, and
        # XLA would then gather the whole batch's logits gradient for the head's weight gradient
        x = constrain(x, RESIDUAL)
        x = dropout.dropout(self.final_norm(x), dropout_keys, self.config.dropout_rate, dropout.HEAD)
        return self.output_head(x)

    def output_head(self, x: jax.Array) -> jax.Array:
        """The LM head on normed hidden states [B, S, D] (also MTP's, after its own norm) ->
        float32 logits [B, S, V]."""
        if self.tied:  # MaxText's head (its table holds embed_scale; tied_head_bf16 rounds it: Embed.attend)
            logits = self.embed.attend(x, *self.tied_scale, self.config.tied_head_bf16)
        else:
            logits = self.logits(x)
        logits = logits.astype(jnp.float32)
        if self.soft_cap > 0:
            logits = self.soft_cap * jnp.tanh(logits / self.soft_cap)
        return constrain(logits, ("activation_batch", "activation_length", "activation_vocab"))
