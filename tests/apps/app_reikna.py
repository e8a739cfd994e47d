"""A reikna application on its own pyopencl context: a 2-D FFT and a matrix product,
checked against numpy; writes its results to ``argv[1]`` (.npz)."""

import sys

import numpy as np
import pyopencl as cl
from reikna.cluda import ocl_api
from reikna.fft import FFT
from reikna.linalg import MatrixMul

ctx = cl.create_some_context(interactive=False)
thr = ocl_api().Thread(cl.CommandQueue(ctx))
rng = np.random.default_rng(2)
x = (rng.random((32, 32)) + 1j * rng.random((32, 32))).astype(np.complex64)
fft = FFT(x, axes=(0, 1)).compile(thr)
xd = thr.to_device(x)
yd = thr.empty_like(xd)
fft(yd, xd)
a = rng.random((24, 16)).astype(np.float32)
b = rng.random((16, 20)).astype(np.float32)
mm = MatrixMul(a, b, out_arr=np.empty((24, 20), np.float32)).compile(thr)
cd = thr.array((24, 20), np.float32)
mm(cd, thr.to_device(a), thr.to_device(b))
out = {"fft": yd.get(), "matmul": cd.get()}
ok = np.allclose(out["fft"], np.fft.fft2(x), rtol=1e-3, atol=1e-2) and \
    np.allclose(out["matmul"], a @ b, rtol=1e-4, atol=1e-4)
np.savez(sys.argv[1], **out)
print("reikna app:", "OK" if ok else "MISMATCH")
sys.exit(0 if ok else 1)
