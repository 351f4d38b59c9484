"""dispatch.py: the choices per instruction set, as its table says, and the cut of work that follows them."""

import pytest

from gpt2numba.cpu import dispatch

_SSE = {"64bit", "sse", "sse2", "sse3", "ssse3", "sse4.1", "sse4.2", "popcnt", "cx16"}
_AVX2 = _SSE | {"avx", "avx2", "fma", "f16c", "bmi", "bmi2", "lzcnt", "movbe"}
_AVX512 = _AVX2 | {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}

# dispatch.py's table: (ROWS_MAX, BF16_ROWS_MAX, HEAD_ROWS_MAX, INT_ROWS_MAX, INT4_ROWS_MAX, tiles' vpdpbusd bits),
# and the instructions behind them (F16C, pmaddwd's int16 lanes, vpmaddubsw, the vpdpbusd of one row's dot products)
TABLE = {
    "AVX-512 with VNNI": (_AVX512 | {"avx512vnni"}, (64, 64, 64, 16, 12, 512), (True, 32, False, (256, 512))),
    "AVX-512": (_AVX512, (64, 64, 64, 10, 4, 0), (True, 32, False, ())),
    "AVX2 with AVX-VNNI": (_AVX2 | {"avxvnni"}, (32, 64, 16, 16, 8, 256), (True, 16, True, (256,))),
    "AVX2": (_AVX2, (32, 64, 16, 16, 12, 0), (True, 16, True, ())),
    "AVX": (_SSE | {"avx"}, (3, 7, 10, 10, 4, 0), (False, 8, False, ())),
    "SSE2": (_SSE, (3, 7, 10, 10, 4, 0), (False, 8, False, ())),
    "not x86": (None, (64, 64, 64, 10, 4, 0), (True, 0, False, ())),
}

# bf16_dot_rows_max without AVX512_BF16: where bfloat16 activations' rows leave the tiles for BLAS (AVX2's measured
# 24), else bfloat16's own
BF16_DOT_ROWS_MAX = {"AVX-512 with VNNI": 64, "AVX-512": 64, "AVX2 with AVX-VNNI": 24, "AVX2": 24, "AVX": 7, "SSE2": 7,
                     "not x86": 64}


@pytest.mark.parametrize("isa", TABLE)
def test_choices_per_instruction_set(isa):
    features, thresholds, instructions = TABLE[isa]
    c = dispatch.choose(None if features is None else frozenset(features))
    assert (c.rows_max, c.bf16_rows_max, c.head_rows_max, c.int_rows_max, c.int4_rows_max, c.tile_vnni) == thresholds
    assert (c.f16c, c.madd_width, c.byte_madd, c.nibble_vnni) == instructions
    assert c.bf16_dot_rows_max == BF16_DOT_ROWS_MAX[isa]


def test_bfloat16_dot_products_leave_the_tiles_at_32_rows():
    zen4 = dispatch.choose(frozenset(_AVX512 | {"avx512vnni", "avx512bf16"}))
    assert (zen4.bf16_dot, zen4.bf16_dot_rows_max) == (True, 32)


def test_the_matrix_tiles_need_all_three_features():
    sapphire_rapids = _AVX512 | {"avx512vnni", "avx512bf16", "amx-tile", "amx-bf16", "amx-int8"}
    assert dispatch.choose(frozenset(sapphire_rapids)).amx
    for feature in ("amx-tile", "amx-bf16", "amx-int8"):
        assert not dispatch.choose(frozenset(sapphire_rapids - {feature})).amx
    assert not dispatch.choose(None).amx


def test_this_cpu_is_chosen_for_once():
    assert dispatch.CHOICES == dispatch.choose(dispatch.FEATURES)
    assert (dispatch.ROWS_MAX, dispatch.INT4_ROWS_MAX, dispatch.TILE_VNNI) == (
        dispatch.CHOICES.rows_max, dispatch.CHOICES.int4_rows_max, dispatch.CHOICES.tile_vnni)


def test_the_cut_of_work():
    """The same chunks for 1 and 2 threads (the same bits), 4 a thread beyond."""
    assert dispatch.n_chunks(1) == dispatch.n_chunks(2) == dispatch.MIN_CHUNKS == 8
    assert dispatch.n_chunks(12) == 48
