"""Which kernel runs, from how many rows and in how many chunks: the CPU probed once, every threshold here.

The kernels ask nothing of the CPU: this module reads the x86 features of the CPU Numba compiles
for (x86_features, once, at import), and choose() turns them into the kernels' instructions and
the row thresholds, as CTranslate2 keeps one get_cpu_isa() and a table per ISA. What they come to
on the CPUs that matter (tests/test_dispatch.py holds choose() to this table):

    instruction set                ROWS_MAX  BF16_ROWS_MAX  HEAD_ROWS_MAX  INT_ROWS_MAX  INT4_ROWS_MAX  integer tiles
    AVX-512 with VNNI (Zen 4)         64          64             64            16            12       vpdpbusd, 512 bits
    AVX-512 (Skylake-X)               64          64             64            10             4       pmaddwd, 512 bits
    AVX2 with AVX-VNNI (Alder Lake)   32          64             16            16             8       vpdpbusd, 256 bits
    AVX2 (Zen 3)                      32          64             16            16            12       pmaddwd, 256 bits
    SSE2 or AVX                        3           7             10            10             4       pmaddwd, 128 bits
    not x86                           64          64             64            10             4       generic vectors

amx says whether the CPU has Intel's matrix tiles (amx-tile, amx-bf16, amx-int8: amx.py, which asks Linux for
them); no product runs on them yet. bf16_dot_rows_max, where bfloat16 activations' products leave rowtiles' tiles
for paneltiles' panels, is 32 with AVX512_BF16 (where `vdpbf16ps` multiplies them), 24 with AVX2 (where BLAS takes
them) and BF16_ROWS_MAX's value elsewhere.
Each number's measurement is one line beside it, in full in docs/performance.md, "Thresholds" (2 vCPUs,
GPT-2 small's matrices). `gpt2numba tune` measures the row thresholds on the CPU it runs on and writes
them to a file (tuning.py) whose values replace this table's here, at import; DEFAULTS keeps the table's.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import NamedTuple

from . import tuning

AMX_FEATURES = ("amx-tile", "amx-bf16", "amx-int8")  # Intel's matrix tiles, as LLVM names them (amx.py)
GROUP = 32  # inputs per int8/int4 scale (model/compact.py); divides every GPT-2 width (768 ... 1600) and 4x it


def x86_features() -> frozenset[str] | None:
    """The x86 features enabled for the CPU Numba compiles for ("avx2", "f16c", ...): NUMBA_CPU_FEATURES
    where it is set, else the host's as LLVM reads them; None off x86."""
    from llvmlite import binding
    from numba.core import config

    if not binding.get_process_triple().startswith(("x86_64", "i686", "i386")):
        return None
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else binding.get_host_cpu_features().flatten()
    return frozenset(f[1:] for f in features.split(",") if f.startswith("+"))


def cpu_name() -> str:
    """The CPU as Linux names it ("AMD EPYC 7B13"), for reports; else what the platform module says."""
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


class Choices(NamedTuple):
    """What a CPU's features decide."""

    f16c: bool  # half floats converted by instructions (kernels._half_to_float32), else in integer code
    madd_width: int  # int16 lanes of the widest pmaddwd: 32 (AVX-512BW), 16 (AVX2), 8 (SSE2); 0 off x86
    byte_madd: bool  # one row's int8 dot products by AVX2's vpmaddubsw (intkernels._madd_signed_bytes)
    nibble_vnni: tuple[int, ...]  # vector bits of the vpdpbusd of _dot_row (int4's nibbles; int8 at 512 bits)
    tile_vnni: int  # bits of the vpdpbusd of the integer tiles' quads (inttiles.QUADS); 0: pmaddwd's pairs
    bf16_dot: bool  # bfloat16 activations' products by AVX512_BF16's vdpbf16ps on 512 bits (rowtiles), else widened
    rows_max: int  # float32 rows up to which _rows_product runs (its matrix [out, in] as kept), not BLAS
    bf16_rows_max: int  # bfloat16 rows up to which _rows_product runs, not BLAS on the widened matrix
    head_rows_max: int  # rows up to which the head is _rows_product, not BLAS
    int_rows_max: int  # int8 rows up to which intkernels._int_rows runs, not the tiles
    int4_rows_max: int  # the same for int4
    bf16_dot_rows_max: int  # bfloat16 activations' rows up to which rowtiles' tiles run, not paneltiles (BF16_DOT),
    # or without AVX512_BF16 BLAS on the rounded values
    amx: bool  # Intel's matrix tiles (tdpbf16ps, tdpbusd: amx.py), which Linux lends on request; no kernel yet


def choose(features: frozenset[str] | None) -> Choices:
    """The Choices for a CPU with these x86 features (None: not x86)."""
    f = features or frozenset()
    madd_width = 0 if features is None else 32 if "avx512bw" in f else 16 if "avx2" in f else 8
    byte_madd = madd_width == 16 and GROUP % 32 == 0  # (not measured on AVX-512 against its 512-bit pmaddwd)
    vnni_256 = "avxvnni" in f or {"avx512vnni", "avx512vl"} <= f  # (AVX-VNNI's encoding where there is no AVX-512)
    nibble_vnni = ((256, 512) if "avx512vnni" in f else (256,)) if GROUP == 32 and vnni_256 else ()
    tile_vnni = 512 if madd_width == 32 and "avx512vnni" in f else 256 if madd_width == 16 and vnni_256 else 0
    avx512 = features is None or "avx512f" in f  # (off x86, unmeasured: as AVX-512)
    avx2 = madd_width == 16  # (AVX2 without AVX-512)
    bf16_dot = madd_width == 32 and "avx512bf16" in f
    bf16_rows_max = 64 if avx512 or avx2 else 7
    # Each threshold's measurement in one line; in full in docs/performance.md, "Thresholds". AVX2's: `gpt2numba
    # tune` on AMD EPYC Zen 3 (2 vCPUs, 2026-12-07), ms of the few-rows kernel / the other's, two runs
    return Choices(
        f16c=features is None or "f16c" in f,  # (ARM converts half floats in instructions)
        madd_width=madd_width, byte_madd=byte_madd, nibble_vnni=nibble_vnni, tile_vnni=tile_vnni,
        bf16_dot=bf16_dot,
        # AVX2, the tiles against BLAS: 8 rows 6.7/18.6 and 6.8/14.3, 32 rows 24.0/24.0 and 21.1/22.7, 48 rows
        # 63.5/46.7 and 26.8/25.7; AVX-512: 64 won; SSE2 and AVX: BLAS from 4 rows (before the tiles)
        rows_max=64 if avx512 else 32 if avx2 else 3,
        # AVX2: 8 rows 5.3/30.9 and 5.5/16.5, 64 rows 36.7/42.5 and 32.4/33.4; AVX-512: 8.0-8.2 ms a layer at 64
        # rows, BLAS 10.3 at 80; SSE2 and AVX: BLAS on the widened matrix 0.97x the old kernel's time at 8 rows
        bf16_rows_max=bf16_rows_max,
        # AVX2: 8 rows 9.2/14.3 and 8.4/14.6, 16 rows 16.0/17.9 and 15.8/16.9, 24 rows 21.4/19.8 and 20.8/21.5;
        # AVX-512, the tiles: BLAS took 1.68x their time at 16 rows, 1.28x at 32, 1.02x at 64 in float32, 2.32x,
        # 1.73x, 1.31x in bfloat16; SSE2 and AVX: BLAS 0.97-1.02x at 12 rows (before the tiles)
        head_rows_max=64 if avx512 else 16 if avx2 else 10,
        # AVX-512 VNNI (vpdpbusd, four rows at once): a decode_batch step of 16 rows 35-36 ms against the tiles'
        # 44-46, 24 rows the same; AVX2: 12 rows 7.4/7.5 and 7.3/9.2, 16 rows 9.2/8.9 and 11.4/11.5, 24 rows
        # 14.4/11.7 and 13.4/12.6; else 10 rows 5.4 ms against the tiles' 5.9, 12 rows 6.3 against 5.9 (Zen 3, before)
        int_rows_max=16 if 512 in nibble_vnni or avx2 else 10,
        # AVX-512 VNNI: 12 rows 27-31 ms a step against the tiles' 37, 16 rows 38-45 against 39; AVX-VNNI: 8 rows 27.2
        # against 33.6 (before four rows at once); AVX2: 12 rows 7.3/7.5 and 7.8/8.7, 16 rows 9.6/9.5 and 10.7/10.2;
        # else 4: 3.0 against 3.1
        int4_rows_max=12 if 512 in nibble_vnni else 8 if nibble_vnni else 12 if byte_madd else 4,
        # AVX512_BF16 (Zen 4): 4 layers' matrices, 24 rows 7.3 ms in the tiles, 7.7 in panels; 32 rows 8.5 and
        # 8.5; 48 rows 12.0 and 10.0; AVX2, tiles that widen both operands against BLAS: 24 rows 15.7/20.2 and
        # 28.3/36.6, 32 rows 37.4/38.2 and 27.0/26.2, 48 rows 35.8/30.5 and 38.4/31.3; else as bfloat16's own
        bf16_dot_rows_max=32 if bf16_dot else 24 if avx2 else bf16_rows_max,
        amx=set(AMX_FEATURES) <= f,
    )


FEATURES = x86_features()
X86 = FEATURES is not None  # whether Numba compiles for an x86 CPU: x86 instructions may be named
DEFAULTS = choose(FEATURES)
TUNING = tuning.load(tuning.key(cpu_name(), FEATURES))  # this CPU's measured thresholds, if tuned
CHOICES = DEFAULTS._replace(**TUNING.values)
F16C = CHOICES.f16c
MADD_WIDTH = CHOICES.madd_width
BYTE_MADD = CHOICES.byte_madd
NIBBLE_VNNI = CHOICES.nibble_vnni
TILE_VNNI = CHOICES.tile_vnni
BF16_DOT = CHOICES.bf16_dot
ROWS_MAX = CHOICES.rows_max
BF16_ROWS_MAX = CHOICES.bf16_rows_max
HEAD_ROWS_MAX = CHOICES.head_rows_max
INT_ROWS_MAX = CHOICES.int_rows_max
INT4_ROWS_MAX = CHOICES.int4_rows_max
BF16_DOT_ROWS_MAX = CHOICES.bf16_dot_rows_max
AMX = CHOICES.amx


def describe_bf16() -> str:
    """How products with bfloat16 activations multiply here: for `gpt2numba check`."""
    if BF16_DOT:
        return "vdpbf16ps (AVX512_BF16), 32 products into 16 float32 sums an instruction"
    return ("widened to float32 in registers for a few rows, BLAS on the rounded values for many "
            "(this CPU has no AVX512_BF16 with AVX-512)")


def describe_tuning() -> str:
    """Which row thresholds this process uses, and where each came from: for `gpt2numba check`."""
    values = ", ".join(f"{name} {getattr(CHOICES, name)}" + (
        f" (measured; default {getattr(DEFAULTS, name)})" if name in TUNING.values else " (default)")
        for name in tuning.TUNABLE)
    if not TUNING.values:
        return (f"{values}: {TUNING.why_not}; `gpt2numba tune` measures them on this CPU in a minute or two (from how "
                "many rows each format's products leave the few-rows kernels for BLAS or the integer tiles), and every "
                "later process here takes them")
    threads = TUNING.entry.get("measured", {}).get("threads", "?")
    return (f"{values}: measured by `gpt2numba tune` with {threads} threads on {TUNING.entry.get('written', '?')}, "
            f"from {TUNING.path}")


# --- the same on every CPU -------------------------------------------------------------------------------

# Rows up to which layernorm and GELU run on the calling thread, not in a parallel region,
# whose barrier waits for any thread the OS took away: a decode step opens 5 a layer, the products and attention
SERIAL_ROWS = 8
# Chunks of rows in those kernels past SERIAL_ROWS, and in the integer tiles' input layout (not measured)
ROW_CHUNKS = 32
# Chunks per thread in the other parallel kernels (beside a busy loop, a decode step took 88-173 ms without them,
# 43 alone); at least MIN_CHUNKS, so that 1 and 2 threads cut the work alike and give the same bits
CHUNKS_PER_THREAD = 4
MIN_CHUNKS = 8
# Bytes ahead of its reads that the integer formats' one-row dot products ask the CPU to fetch their matrix
# (intkernels._dot_row): a decode step at context 128 took 0.94x (int8) and 0.91x (int4) the
# time without, 2048 and 8192 bytes alike within the runs' spread; bfloat16's row kernels took 1.17x with it (AMD
# EPYC Zen 4, alternating runs; docs/performance.md, "The decode floor")
PREFETCH_BYTES = 4096


def n_chunks(threads: int) -> int:
    """The chunks every parallel kernel of a pass cuts its work into, for this many threads."""
    return max(MIN_CHUNKS, threads * CHUNKS_PER_THREAD)
