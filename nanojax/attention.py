"""The paged attention switch: the jnp reference or the Pallas kernels, behind one signature
`attention(q [B,T,Hq,D], k_pages, v_pages, page_table, seq_lens, q_lens, *, scale) -> [B,T,Hq,D]`."""
import functools

import jax

from pallas_kernels.paged_attention import paged_attention_reference


def pallas_attention(q, k_pages, v_pages, page_table, seq_lens, q_lens, *, scale, interpret=False):
    from pallas_kernels.paged_attention import paged_decode_attention, paged_prefill_attention

    if q.shape[1] == 1:  # decode: one new token per row
        out = paged_decode_attention(q[:, 0], k_pages, v_pages, page_table, seq_lens, scale=scale,
                                     interpret=interpret)
        return out[:, None]
    return paged_prefill_attention(q, k_pages, v_pages, page_table, seq_lens, q_lens, scale=scale,
                                   interpret=interpret)


IMPLEMENTATIONS = {
    "reference": paged_attention_reference,
    "pallas": pallas_attention,
    "pallas_interpret": functools.partial(pallas_attention, interpret=True),
}


def get_attention(name: str):
    if name == "auto":
        name = "pallas" if jax.default_backend() == "gpu" else "reference"
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"attention={name!r} is not one of {['auto', *IMPLEMENTATIONS]}")
    return IMPLEMENTATIONS[name]
