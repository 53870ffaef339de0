"""W8A8: matmuls of FP8 activations and FP8 weights on the tensor cores, with the library's scales."""
