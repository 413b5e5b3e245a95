"""HF's RMSNorm in plain jnp with its rounding, for the model and the kernels' references (which import no nanojax)."""
import jax.numpy as jnp
from jax import lax


def rms_normalize(x, eps):
    """x / RMS(x) as HF's RMSNorm before its scale: in f32, rounded to x.dtype. x: [..., K] -> [..., K]."""
    xf = x.astype(jnp.float32)
    return (xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def rms_norm(x, scale, eps):
    """rms_normalize, then times the weight in x.dtype (HF's order). x: [..., K]; scale: [K] -> [..., K]."""
    return scale.astype(x.dtype) * rms_normalize(x, eps)
