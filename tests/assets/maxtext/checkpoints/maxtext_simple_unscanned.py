"""Run a MaxText 0.2.5 entry point with its unscanned simple layers fixed (runs inside the MaxText env).

python maxtext_simple_unscanned.py -m maxtext.trainers.pre_train.train <args>   (a module)
python maxtext_simple_unscanned.py maxtext_logits.py <args>                      (a script)

MaxText 0.2.5's ``SimpleDecoderLayer`` / ``SimpleMlpDecoderLayer`` return the bare output when
``scan_layers=false``, but its unscanned decoder loop (``nnx_decoders.py: pure_layer_fn``) unpacks
``(y, kv_cache)``: "not enough values to unpack (expected 2, got 1)". This wrapper makes the
layers return ``(y, None)`` there, as they do scanned — the packaging only, the function and the
parameter tree are MaxText's. Used only to make the ``simple*_unscanned`` test assets.
"""

import runpy
import sys

from maxtext.models import simple_layer


def _paired(cls: type) -> None:
    call = cls.__call__

    def wrapped(self, *args, **kwargs):
        out = call(self, *args, **kwargs)
        return out if isinstance(out, tuple) else (out, None)

    cls.__call__ = wrapped


_paired(simple_layer.SimpleDecoderLayer)
_paired(simple_layer.SimpleMlpDecoderLayer)

if __name__ == "__main__":
    if sys.argv[1] == "-m":
        sys.argv = [sys.argv[2], *sys.argv[3:]]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")
