"""The private JAX and qwix symbols of ``runtime/private_api.py``, pinned: the installed versions
are those the adapter was checked against, and each symbol still exists and behaves as used.
An upgrade turns this file red; then check each function against the new sources and update
``CHECKED_VERSIONS``."""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
import qwix
from flax import nnx

from nnxtron.runtime import private_api


@pytest.mark.parametrize("package", sorted(private_api.CHECKED_VERSIONS))
def test_installed_versions_are_the_checked_ones(package):
    assert importlib.metadata.version(package) == private_api.CHECKED_VERSIONS[package], (
        f"{package} changed: check runtime/private_api.py against its new sources, then update CHECKED_VERSIONS"
    )


def test_backends_and_compilation_cache_directory_as_jax_starts(tmp_path):
    """In a fresh process: no backend before the first use of a device, one after; no cache
    before the first compile, the configured directory after it, none after a reset."""
    script = textwrap.dedent(f"""
        import jax
        from jax.experimental.compilation_cache import compilation_cache
        from nnxtron.runtime import private_api as api

        seen = [api.backends_are_initialized(), api.compilation_cache_dir()]
        jax.config.update("jax_compilation_cache_dir", {str(tmp_path)!r})
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.jit(lambda x: x + 1)(1.0)
        seen += [api.backends_are_initialized(), api.compilation_cache_dir()]
        compilation_cache.reset_cache()
        seen.append(api.compilation_cache_dir())
        print(seen)
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == str([False, None, True, str(tmp_path), None]), out.stderr


def test_coordination_client_is_none_before_distributed_start_and_has_the_key_value_store():
    """The peer watch (``runtime/distributed.py``) reads and writes heartbeats through the
    client's key-value store; tests/integration/test_multihost.py runs it for real."""
    from jax._src.lib import _jax  # the client's type, checked here only

    assert private_api.coordination_client() is None  # this process never starts jax.distributed
    for method in ("key_value_set", "key_value_try_get"):
        assert callable(getattr(_jax.DistributedRuntimeClient, method)), method


def test_qwix_module_path_and_find_param_inside_an_intercepted_call():
    """A quantized module's matmul sees its own path and which operand is its parameter."""
    seen = []

    class Recording(qwix.QtProvider):
        def dot_general(self, lhs, rhs, *args, **kwargs):
            rule, _ = self._get_current_rule_and_op_id("dot_general", only_rule=True)  # models/quant.py's use
            seen.append((private_api.qwix_module_path(), private_api.qwix_find_param(lhs), private_api.qwix_find_param(rhs)))
            seen.append(rule is not None and rule.weight_qtype == jnp.int8)
            return jax.lax.dot_general(lhs, rhs, *args, **kwargs)

    class Inner(nnx.Module):
        def __init__(self):
            self.kernel = nnx.Param(jnp.ones((4, 2)))

        def __call__(self, x):
            return jax.lax.dot_general(x, self.kernel[...], (((1,), (0,)), ((), ())))

    class Outer(nnx.Module):
        def __init__(self):
            self.inner = Inner()

        def __call__(self, x):
            return self.inner(x)

    rule = qwix.QtRule(module_path=".*", weight_qtype=jnp.int8)
    model = qwix.quantize_model(Outer(), Recording([rule]), jnp.ones((3, 4)))
    model(jnp.ones((3, 4)))
    assert seen[-2:] == [(("inner",), None, "kernel"), True], seen
    assert list(inspect.signature(private_api.qwix_find_param).parameters) == ["x"]
