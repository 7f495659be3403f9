"""MaxText's logits on fixed tokens from a MaxText checkpoint (runs inside the MaxText 0.2.5 env).

python maxtext_logits.py OUT.npy <maxtext base.yml> key=value ... load_parameters_path=CKPT/0/items

Tokens: ``(arange(2 * 8) * 7 + 3) % vocab_size`` as [2, 8], positions 0..7, one segment;
MaxText's model in train mode with dropout off, float32. Used only to make test assets.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from maxtext.configs import pyconfig
from maxtext.utils import model_creation_utils


def main(out: str, argv: list[str]) -> None:
    config = pyconfig.initialize([sys.argv[0], *argv])
    model, _ = model_creation_utils.from_pretrained(config)
    tokens = (jnp.arange(2 * 8, dtype=jnp.int32) * 7 + 3).reshape(2, 8) % config.vocab_size
    positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
    segments = jnp.ones((2, 8), jnp.int32)
    # jitted: MaxText's eager scanned-layer loop deletes arrays it still reads (DeepSeek)
    forward = nnx.jit(lambda m, t, p, s: m(t, p, decoder_segment_ids=s, enable_dropout=False))
    logits = forward(model, tokens, positions, segments)
    np.save(out, np.asarray(jax.device_get(logits), np.float32))
    print("saved", out, logits.shape, float(jnp.abs(logits).max()))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
