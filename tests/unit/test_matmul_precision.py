"""``matmul_precision``: every matmul of the traced train, eval and decode steps (forward and
gradient, dense and grouped) carries the setting; ``default`` leaves JAX's default (no precision
recorded); on CPU in float32 the values do not change; MaxText's names translate; a bad value is
one error line."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax._src.lax.lax import ragged_dot_general_p  # not exported by jax.lax

from nnxtron.config import derive
from nnxtron.config.loader import load_config
from nnxtron.errors import ConfigError
from nnxtron.infer.decode import prompt_batch, with_caches
from nnxtron.models.build import build_model
from nnxtron.parallel.mesh import make_mesh
from nnxtron.tools.parity import loss_and_grads
from nnxtron.train.optimizer import make_optimizer
from nnxtron.train.state import setup
from nnxtron.train.step import make_eval_step, make_train_step
from tests.conftest import random_batch, tiny_config
from tests.integration.conftest import assert_user_error, run_cli

BASE = Path(__file__).resolve().parents[1] / "assets" / "maxtext" / "base.yml"
MATMULS = (lax.dot_general_p, ragged_dot_general_p)
MOE = dict(base_num_decoder_layers=2, mtp_num_layers=1)  # routed experts, the MTP depth, both heads
EXPECTED = {"default": None, "high": (lax.Precision.HIGH,) * 2, "highest": (lax.Precision.HIGHEST,) * 2}


def _precisions(jaxpr) -> list:
    """The ``precision`` of every matmul in ``jaxpr`` and its sub-jaxprs (scan, remat, jit, shard_map ...)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive in MATMULS:
            found.append((eqn.primitive, eqn.params["precision"]))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _precisions(inner)
    return found


def _steps(precision: str, grouped_matmul: str) -> dict[str, list]:
    """The matmul precisions of the traced train step, eval step and cached decode step."""
    cfg = tiny_config("deepseek3-test", matmul_precision=precision, grouped_matmul=grouped_matmul, **MOE)
    tx, schedule = make_optimizer(cfg, derive(cfg, 1))
    model_setup = setup(cfg, make_mesh(cfg, jax.devices()[:1]), tx)
    state, batch = model_setup.abstract_state, random_batch(cfg, batch=2, seq=8)
    cached = with_caches(build_model(cfg), 1, 8)
    prompt = {k: jnp.asarray(v) for k, v in prompt_batch([[5, 6, 7]], 4).items()}
    decode = jax.make_jaxpr(cached._step)(cached.params, cached.state, cached.caches, *prompt.values())
    return {
        "train": _precisions(jax.make_jaxpr(make_train_step(cfg, model_setup, tx, schedule))(state, batch).jaxpr),
        "eval": _precisions(jax.make_jaxpr(make_eval_step(cfg, model_setup))(state, batch).jaxpr),
        "decode": _precisions(decode.jaxpr),
    }


@pytest.mark.parametrize(
    "precision, grouped_matmul", [("default", "ragged_dot"), ("highest", "ragged_dot"), ("highest", "blocked")]
)
def test_every_matmul_of_the_steps_carries_the_precision(precision, grouped_matmul):
    # the routed experts are a ragged_dot, or blocked dot_generals (parallel/grouped_matmul.py)
    primitives = set(MATMULS) if grouped_matmul == "ragged_dot" else {lax.dot_general_p}
    for step, found in _steps(precision, grouped_matmul).items():
        assert {primitive for primitive, _ in found} == primitives, step
        assert {p for _, p in found} == {EXPECTED[precision]}, (step, {p for _, p in found})


def test_high_reaches_the_model_call():
    graphdef, state = nnx.split(build_model(tiny_config("deepseek3-test", matmul_precision="high", **MOE)))
    forward = jax.make_jaxpr(lambda state, tokens: nnx.merge(graphdef, state)(tokens).logits)
    found = _precisions(forward(state, jnp.ones((1, 8), jnp.int32)).jaxpr)
    assert {p for _, p in found} == {EXPECTED["high"]}


def test_float32_values_on_cpu_do_not_change():
    small = dict(base_num_decoder_layers=1)  # one MoE layer: dense and grouped matmuls
    batch = random_batch(tiny_config("mixtral-tiny", **small), batch=2, seq=8)
    results = [loss_and_grads(build_model(tiny_config("mixtral-tiny", matmul_precision=p, **small)), batch)
               for p in ("default", "highest")]  # fmt: skip
    assert results[0].loss == results[1].loss
    np.testing.assert_array_equal(results[0].input_grad, results[1].input_grad)
    assert results[0].param_grads.keys() == results[1].param_grads.keys()
    for name, grad in results[0].param_grads.items():
        np.testing.assert_array_equal(grad, results[1].param_grads[name], err_msg=name)


@pytest.mark.parametrize(("value", "expected"), [("default", "default"), ("bfloat16", "default"), ("high", "high"),
                                                 ("highest", "highest"), ("float32", "highest")])  # fmt: skip
def test_maxtexts_names_translate(value, expected):
    assert load_config(BASE, [f"matmul_precision={value}"]).matmul_precision == expected


def test_a_bad_value_is_one_error_line(capsys):
    with pytest.raises(ConfigError, match="matmul_precision"):
        load_config(None, ["matmul_precision=fastest"])
    for args in ([], [str(BASE)]):
        code, _, err = run_cli(capsys, "config", "show", *args, "matmul_precision=fastest")
        assert_user_error(code, err, "matmul_precision")
