"""Remat (activation checkpointing) policies by name, MaxText-compatible (the names:
``config.options.REMAT_POLICIES``).

Blocks tag their activations with ``jax.ad_checkpoint.checkpoint_name`` using the names
in ``ACTIVATIONS``; a policy says which tagged values the backward pass may keep on
device, which it may offload to host memory, and (by omission) which it recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax

from nnxtron.config.options import REMAT_POLICIES
from nnxtron.errors import ConfigError

# Every named activation a block may tag (the same names in every family).
ACTIVATIONS = (
    "decoder_layer_input",
    "query_proj",
    "key_proj",
    "value_proj",
    "context",
    "out_proj",
    "mlpwi_0",
    "mlpwi_1",
    "mlpwo",
    "qkv_proj",  # a fused q/k/v projection (GPT-3): follows query/key/value_proj when they agree
)
# The name of every low-precision weight product (``layers/matmul.py``): a policy cannot see the
# dot inside its custom_vjp, so "dots without batch dimensions" policies keep it by this name.
WEIGHT_PRODUCT = "weight_product"
QKV = ("query_proj", "key_proj", "value_proj")
FUSED_QKV = "qkv_proj"  # the name of a fused q/k/v projection's output
_SAVED_NAMES = {
    "save_dot_with_context_except_mlp": (*QKV, FUSED_QKV, "context", "out_proj"),
    "save_dot_except_mlpwi": (*QKV, FUSED_QKV, "out_proj", "mlpwo"),
    "save_dot_except_mlp": (*QKV, FUSED_QKV, "out_proj"),
    "save_qkv_proj": (*QKV, FUSED_QKV),
    "save_out_proj": ("out_proj",),
}
OFFLOADING = ("qkv_proj_offloaded", "minimal_offloaded")
OFFLOAD_SRC, OFFLOAD_DST = "device", "pinned_host"


@dataclass(frozen=True)
class RematSpec:
    """A remat policy name plus, for ``custom``, the choice for each named activation."""

    policy: str = "full"
    custom: tuple[tuple[str, str], ...] = ()  # (activation, "remat" | "device" | "offload")

    @classmethod
    def from_config(cls, cfg: Any) -> RematSpec:
        """Read remat_policy and, for custom, one choice per activation: the activation's own
        key, or its shorthand (qkv_proj, mlpwi) when the own key is left at "remat"; a fused
        q/k/v projection takes the choice its three parts agree on (``config/checks.py``
        refuses parts that disagree for a family that fuses them)."""
        if cfg.remat_policy != "custom":
            return cls(cfg.remat_policy)
        shorthand = {name: FUSED_QKV for name in QKV} | {"mlpwi_0": "mlpwi", "mlpwi_1": "mlpwi"}
        custom = {}
        for name in ACTIVATIONS:
            own = getattr(cfg, name)
            custom[name] = getattr(cfg, shorthand[name]) if own == "remat" and name in shorthand else own
        parts = {custom[name] for name in QKV}
        custom[FUSED_QKV] = parts.pop() if len(parts) == 1 else "remat"
        return cls("custom", tuple(sorted(custom.items())))

    @property
    def offloads(self) -> bool:
        return self.policy in OFFLOADING or any(choice == "offload" for _, choice in self.custom)

    def names(self, choice: str) -> tuple[str, ...]:
        return tuple(name for name, c in self.custom if c == choice)


def _dots_or_names(dots: Any, names: Any) -> Any:
    """``dots`` for ``dot_general`` results, ``names`` for everything else (offloading policies
    return more than a bool, which ``save_from_both_policies`` refuses)."""

    def policy(prim: Any, *args: Any, **params: Any) -> Any:
        return dots(prim, *args, **params) if prim is jax.lax.dot_general_p else names(prim, *args, **params)

    return policy


def jax_policy(spec: RematSpec) -> Any:
    """The ``jax.checkpoint`` policy for ``spec``; None means "do not remat at all".

    "Dots without batch dimensions" (``minimal`` and its variants) include the weight products
    of ``layers/matmul.py``, which reach the policy by their name ``WEIGHT_PRODUCT``."""
    cp = jax.checkpoint_policies
    name = spec.policy
    if name == "none":
        return None
    if name == "full":
        return cp.nothing_saveable
    if name == "minimal":
        return cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable, cp.save_only_these_names(WEIGHT_PRODUCT))
    if name == "minimal_with_context":
        return cp.save_from_both_policies(
            cp.dots_with_no_batch_dims_saveable, cp.save_only_these_names(WEIGHT_PRODUCT, "context")
        )
    if name in _SAVED_NAMES:
        return cp.save_only_these_names(*_SAVED_NAMES[name])
    if name == "qkv_proj_offloaded":
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=[*QKV, FUSED_QKV],
            offload_src=OFFLOAD_SRC,
            offload_dst=OFFLOAD_DST,
        )
    if name == "minimal_offloaded":
        return _dots_or_names(
            cp.offload_dot_with_no_batch_dims(OFFLOAD_SRC, OFFLOAD_DST),
            cp.save_and_offload_only_these_names(
                names_which_can_be_saved=[],
                names_which_can_be_offloaded=[WEIGHT_PRODUCT],
                offload_src=OFFLOAD_SRC,
                offload_dst=OFFLOAD_DST,
            ),
        )
    if name == "custom":
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=list(spec.names("device")),
            names_which_can_be_offloaded=list(spec.names("offload")),
            offload_src=OFFLOAD_SRC,
            offload_dst=OFFLOAD_DST,
        )
    raise ConfigError(f"unknown remat_policy '{name}'; choose one of {', '.join(REMAT_POLICIES)}")


def host_memory_available() -> bool:
    """Whether the default device can address pinned host memory (needed for offloading).
    The CPU backend has it (offloading there is real, just not faster); so do GPUs and TPUs."""
    device = jax.devices()[0]
    try:
        return any(m.kind == OFFLOAD_DST for m in device.addressable_memories())
    except Exception:  # backends without memory-kind support
        return False


def check_offload_supported(spec: RematSpec) -> None:
    if spec.offloads and not host_memory_available():
        raise ConfigError(
            f"remat_policy={spec.policy} offloads activations to '{OFFLOAD_DST}' memory, which the "
            f"{jax.devices()[0].platform} backend does not have; choose a policy without offloading"
        )
