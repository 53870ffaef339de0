"""The README's API example (its output is pasted into README.md)."""

import cupy
import ml_dtypes
import numpy as np

import cupyquant as cq
from cupyquant import reference

x = cupy.asarray(np.linspace(-3, 5, 8, dtype=np.float32).astype(ml_dtypes.bfloat16)).reshape(2, 4)
q = cq.quantize_fp8(x)  # per tensor, E4M3, amax and scale on the device
print(q)
print(q.data)  # the FP8 bytes, uint8
print(q.scale, q.amax)  # scale_inv (x ~ q * scale) and amax
print(q.to_host()["data"])  # viewed as ml_dtypes float8_e4m3fn on the host
print(cq.dequantize(q))  # bfloat16, like x

q8, s = reference.quantize_fp8(x.get())  # the NumPy reference gives the same bytes
print(bool((q8 == q.data.get()).all() and s[0] == q.scale.get()[0]))
