"""Triton kernels for batch-1 decode, one op per file."""
