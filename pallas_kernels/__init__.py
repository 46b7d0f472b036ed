"""Pallas (Triton-style) GPU kernels for jaxinfer. Kernels import jax only, never jaxinfer.

Attention (each kernel has a pure-jnp `*_reference` next to it; `interpret=None`, the default,
runs the kernel in Pallas interpret mode when the default backend is CPU):
    pallas_kernels.ragged_paged_attention  ragged_paged_attention: the serving kernel (a step's
                                           prefill chunks and decode tokens over the KV pages)
    pallas_kernels.flash_attention         flash_attention: one contiguous sequence (no cache)
    pallas_kernels.attention_common        what both share: masking conventions, tile math,
                                           validators, the reference softmax
Import from the submodules: re-exporting `flash_attention` / `ragged_paged_attention` here would
shadow the submodules of the same names.
"""
