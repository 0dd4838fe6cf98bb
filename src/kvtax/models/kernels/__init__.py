"""Triton kernels of the decoder's linear layers (raw kernels; the checked API is
`kvtax.models.gemv`)."""
