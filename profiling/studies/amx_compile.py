"""Intel's matrix tiles from Numba: one tdpbf16ps tile, from LLVM's named AMX intrinsics, compiled for a Sapphire
Rapids CPU on any x86 machine; run and checked against NumPy where this CPU has the tiles and Linux lends them.

    python profiling/studies/amx_compile.py [--run]

The first step of the tile kernels (docs/performance.md, "Intel's matrix tiles"): it shows that the Numba and
llvmlite installed here emit ldtilecfg, tileloadd, tdpbf16ps, tilestored and tilerelease. Compiling for another
CPU runs in a child process whose environment names it (NUMBA_CPU_NAME, NUMBA_CPU_FEATURES; its own Numba
cache). --run multiplies one tile on this CPU: a 16 x 32 bfloat16 input by a tile of weights laid out by
cpu/amx.py's bf16_pairs, against float64.
"""

import argparse
import os
import subprocess
import sys
import tempfile

KERNEL = r'''
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def _one_tile(typingctx, config, a, b, c):
    """c (16, 16) float32 += a (16, 32) bfloat16 bits x b (16, 32) bfloat16 bits laid out by pairs."""
    def codegen(context, builder, signature, args):
        i8, i64 = ir.IntType(8), ir.IntType(64)
        ptr = i8.as_pointer()

        def call(name, *values):
            f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [v.type for v in values]),
                                               name)
            builder.call(f, list(values))

        data = [builder.bitcast(context.make_array(t)(context, builder, v).data, ptr)
                for t, v in zip(signature.args, args)]
        tile, stride = (lambda n: ir.Constant(i8, n)), ir.Constant(i64, 64)  # every tile: rows of 64 bytes
        call("llvm.x86.ldtilecfg", data[0])
        for n, at in ((0, data[3]), (1, data[1]), (2, data[2])):
            call("llvm.x86.tileloadd64", tile(n), at, stride)
        call("llvm.x86.tdpbf16ps", tile(0), tile(1), tile(2))
        call("llvm.x86.tilestored64", tile(0), data[3], stride)
        call("llvm.x86.tilerelease")
        return context.get_dummy_value()
    return types.void(config, a, b, c), codegen


@njit
def one_tile(config, a, b, c):
    _one_tile(config, a, b, c)


def config():
    """The tiles' configuration (palette 1): tiles 0, 1, 2 of 16 rows x 64 bytes."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    cfg[16:22].view(np.uint16)[:] = 64  # bytes a row, tiles 0..2
    cfg[48:51] = 16  # rows, tiles 0..2
    return cfg


ARRAYS = (types.Array(types.uint8, 1, "C"), types.Array(types.uint16, 2, "C"), types.Array(types.uint16, 2, "C"),
          types.Array(types.float32, 2, "C"))
'''

COMPILE = KERNEL + r'''
one_tile.compile(ARRAYS)
print("\n".join(line.strip() for line in one_tile.inspect_asm(one_tile.signatures[0]).splitlines()
                if line.strip().startswith(("ldtilecfg", "tileload", "tdp", "tilestore", "tilerelease"))))
'''

RUN = KERNEL + r'''
from gpt2numba.cpu import amx
from gpt2numba.model import compact

why = amx.request()
if why is not None:
    raise SystemExit(f"not run: the tiles are {amx.describe()}")
rng = np.random.default_rng(0)
a = compact.to_bfloat16(rng.standard_normal((16, 32)).astype(np.float32))
w = compact.to_bfloat16(rng.standard_normal((16, 32)).astype(np.float32))  # [out, in]
c = np.zeros((16, 16), np.float32)
one_tile(config(), a, np.ascontiguousarray(amx.bf16_pairs(w)[0, 0]), c)
exact = compact.from_bfloat16(a).astype(np.float64) @ compact.from_bfloat16(w).astype(np.float64).T
print(f"one tile on this CPU: max |tdpbf16ps - float64| = {np.abs(c - exact).max():.2e} "
      f"(largest |value| {np.abs(exact).max():.1f})")
'''


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="store_true", help="also run the tile on this CPU, if it has the tiles")
    args = p.parse_args()
    from llvmlite import binding

    features = binding.get_host_cpu_features()
    for name in ("amx-tile", "amx-bf16", "amx-int8"):
        features[name] = True
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CPU_NAME": "sapphirerapids", "NUMBA_CPU_FEATURES": features.flatten(),
               "NUMBA_CACHE_DIR": cache}
        asm = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True)
    if asm.returncode:
        print(f"compiling for Sapphire Rapids failed:\n{asm.stderr}", file=sys.stderr)
        return 1
    print("one tile compiled for Sapphire Rapids (Numba, LLVM's AMX intrinsics):")
    print("    " + asm.stdout.strip().replace("\n", "\n    "))
    if args.run:
        ran = subprocess.run([sys.executable, "-c", RUN], capture_output=True, text=True)
        print(ran.stdout.strip() or ran.stderr.strip().splitlines()[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
