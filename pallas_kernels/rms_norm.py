"""HF's RMSNorm in plain jnp, with its rounding: the one definition for the model's norms that are not folded into a
projection (the final norm) and for the kernels' references (rmsnorm_matmul's statistic, qkv_rope_cache's q/k norms).
It lives here, beside the kernels, because the kernel package imports nothing from nanojax."""
import jax.numpy as jnp
from jax import lax


def rms_normalize(x, eps):
    """x / RMS(x) as HF's RMSNorm computes it before its scale: statistics and the product in f32, rounded to
    x.dtype. x: [..., K] -> [..., K]."""
    xf = x.astype(jnp.float32)
    return (xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def rms_norm(x, scale, eps):
    """rms_normalize, then times the weight in x.dtype (HF's order). x: [..., K]; scale: [K] -> [..., K]."""
    return scale.astype(x.dtype) * rms_normalize(x, eps)
