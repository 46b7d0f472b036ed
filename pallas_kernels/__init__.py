"""Pallas (Triton-style) GPU kernels for jaxinfer. Kernels import jax only, never jaxinfer.

Attention (each kernel has a pure-jnp `*_reference` next to it; `interpret=None`, the default,
runs the kernel in Pallas interpret mode when the default backend is CPU):
    pallas_kernels.paged_attention   paged_attention (decode), paged_attention_reference
    pallas_kernels.flash_attention   flash_attention (one sequence), ragged_paged_attention
                                     (chunked prefill + decode tokens), their references
Import from the submodules: re-exporting `paged_attention` / `flash_attention` here would shadow
the submodules of the same names.
"""
