"""MaxText's param-only checkpoint of a MaxText training checkpoint (runs inside the MaxText 0.2.5 env).

python maxtext_params_only.py TRAIN_CKPT/0/items OUT_DIR

Reads the ``params`` item of the training checkpoint and writes it with MaxText's own
``checkpointing.save_params_to_path`` (``OUT_DIR/items``, tree ``params/params/...``, no optimizer
state: a third of the size). Model state that is not an ``nnx.Param`` (DeepSeek's router bias,
``MoEBiasVar``), which a training checkpoint keeps under ``nnx_aux/model``, goes to the
``params/MoEBiasVar`` collection, where MaxText's ``load_params_from_path`` reads it. Used only to
make test assets.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from maxtext.common import checkpointing  # noqa: E402


def main(source: str, out: str) -> None:
    reader = ocp.PyTreeCheckpointer()
    tree = reader.metadata(source).item_metadata.tree
    item = {"params": tree["params"], "nnx_aux": tree.get("nnx_aux", {})}
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    restored = reader.restore(source, item=item, restore_args=args, partial_restore=True)
    params = dict(restored["params"])
    bias = strip_rngs(restored.get("nnx_aux", {}).get("model", {}))
    if bias:
        params["MoEBiasVar"] = bias
    checkpointing.save_params_to_path(out, jax.tree.map(jnp.asarray, params))


def strip_rngs(tree):
    """``tree`` without its RNG streams (``.../rngs/...``); None when nothing is left."""
    if not isinstance(tree, dict):
        return tree
    kept = {k: strip_rngs(v) for k, v in tree.items() if k != "rngs"}
    kept = {k: v for k, v in kept.items() if v is not None}
    return kept or None


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
