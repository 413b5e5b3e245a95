"""nanojax.xla_flags: XLA's defaults nanojax sets, never over the user's own."""
import os
import subprocess
import sys

from nanojax import xla_flags

TILING = "--xla_gpu_experimental_cost_model_gemm_tiling_options=top=4,top_from_default=1"
TRIED = xla_flags.TRIED_JAXLIB[0]


def test_flags_are_added_beside_the_users_own():
    environ = {}
    xla_flags.set_defaults(environ, TRIED)
    assert environ["XLA_FLAGS"] == TILING
    environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    xla_flags.set_defaults(environ, TRIED)
    assert environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {TILING}"
    xla_flags.set_defaults(environ, TRIED)  # once only
    assert environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {TILING}"


def test_a_flag_the_user_names_is_left_as_set():
    environ = {"XLA_FLAGS": "--xla_gpu_experimental_cost_model_gemm_tiling_options=top=8"}
    xla_flags.set_defaults(environ, TRIED)
    assert environ["XLA_FLAGS"] == "--xla_gpu_experimental_cost_model_gemm_tiling_options=top=8"


def test_an_untried_jaxlib_gets_no_flags():
    environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    xla_flags.set_defaults(environ, (0, 99, 0))
    assert environ == {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}


def test_importing_nanojax_sets_them_and_jax_runs_with_them():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    code = ("import nanojax, os, jax.numpy as jnp; assert float(jnp.ones((4, 4)).sum()) == 16; "
            "print(os.environ['XLA_FLAGS'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    if xla_flags.jaxlib_version() in xla_flags.TRIED_JAXLIB:
        assert out.stdout.split() == [TILING]
