#!/usr/bin/env python3
"""Writes tests/engine/data/quant_types.gguf: one small tensor per GGUF type tqkv reads, plus
for each an F32 tensor '<name>.expected' holding what the PyPI `gguf` package's own
dequantizer makes of it. The C++ dequantizer is tested against this independent oracle.

K-quant blocks (Q4_K, Q6_K) have no quantizer in the gguf package, so their codes are
random bytes with the fp16 super-scales overwritten by sane values (random bytes would give
NaN/Inf scales). Regenerate with: python3 tests/integration/make_quant_fixture.py
"""
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf import quants

rng = np.random.default_rng(1234)
out = os.path.join(os.path.dirname(__file__), "..", "engine", "data", "quant_types.gguf")
w = gguf.GGUFWriter(out, "fixture")
w.add_uint32("fixture.answer", 42)
w.add_string("fixture.greeting", "héllo")
w.add_array("fixture.list", [1, 2, 3])

rows, cols = 3, 512
x = rng.standard_normal((rows, cols)).astype(np.float32)


def add(name, raw, qtype):
    w.add_tensor(name, raw, raw_dtype=qtype)
    w.add_tensor(name + ".expected", quants.dequantize(raw, qtype).astype(np.float32))


add("f32", x.copy(), T.F32)
add("f16", x.astype(np.float16), T.F16)
for t in (T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
    add(t.name.lower(), quants.quantize(x, t), t)

for t, block, scale_offsets in ((T.Q4_K, 144, (0, 2)), (T.Q6_K, 210, (208,))):
    raw = rng.integers(0, 256, size=(rows, cols // 256 * block), dtype=np.uint8)
    for b in range(cols // 256):
        for off in scale_offsets:
            s = np.array([rng.uniform(0.001, 0.05)], dtype=np.float16).view(np.uint8)
            raw[:, b * block + off: b * block + off + 2] = s
    add(t.name.lower(), raw, t)

w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print("wrote", os.path.normpath(out), os.path.getsize(out), "bytes", file=sys.stderr)
