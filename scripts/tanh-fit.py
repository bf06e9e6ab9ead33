#!/usr/bin/env python3
"""Fits and checks the polynomial of ir_tanh (src/engines/cuda/kernels/device_math.cuh).

tanh(x) = x + x^3 P(x^2) on [0, 0.6], P of degree 4: weighted least squares on the relative error
of tanh, reweighted towards minimax. Then every float32 of [2^-14, 0.6) is evaluated as the kernel
does (fp32 products, fused multiply-adds) against float64 tanh, and the worst error is printed in
ulp. Needs numpy.  python3 scripts/tanh-fit.py
"""
import numpy as np

DEGREE = 4
x = np.cos(np.linspace(0, np.pi, 4000)) * 0.3 + 0.3
x = x[x > 1e-4]
u = x * x
target = (np.tanh(x) - x) / x**3
weight = x**3 / np.tanh(x)  # an error e in P moves tanh by x^3 e, relative to tanh
reweight = np.ones_like(x)
basis = np.vander(u, DEGREE + 1, increasing=True)
for _ in range(60):
    coefficients, *_ = np.linalg.lstsq(basis * (weight * reweight)[:, None],
                                       target * weight * reweight, rcond=None)
    error = (basis @ coefficients - target) * weight
    reweight *= (np.abs(error) / np.abs(error).max()) ** 0.3 + 1e-3
    reweight /= reweight.max()
c32 = [np.float32(c) for c in coefficients]
print("P (constant term first):", [repr(float(c)) for c in c32])


def fma32(a, b, c):  # one rounding, as fmaf (the product of two floats is exact in float64)
    return (a.astype(np.float64) * b + np.float64(c)).astype(np.float32)


def small_branch(xs):
    square = (xs.astype(np.float64) ** 2).astype(np.float32)
    poly = fma32(np.full_like(xs, c32[-1]), square, c32[-2])
    for c in reversed(c32[:-2]):
        poly = fma32(poly, square, c)
    cube = (xs.astype(np.float64) * square).astype(np.float32)
    return (cube.astype(np.float64) * poly + xs).astype(np.float32)  # fmaf(cube, poly, x)


start = np.float32(2.0**-14).view(np.int32)
end = np.float32(0.6).view(np.int32)
worst = 0.0
for first in range(int(start), int(end), 1 << 22):
    xs = np.arange(first, min(first + (1 << 22), int(end)), dtype=np.int32).view(np.float32)
    reference = np.tanh(xs.astype(np.float64))
    ulp = np.spacing(reference.astype(np.float32)).astype(np.float64)
    worst = max(worst, float((np.abs(small_branch(xs) - reference) / ulp).max()))
print(f"worst error over [2^-14, 0.6): {worst:.3f} ulp")
