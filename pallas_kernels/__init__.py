"""Pallas GPU kernels (Triton lowering), each beside a plain jax.numpy reference."""
