"""The storage kinds' table (src/kinds/fa_kinds.h, read by fastattn._storage.kinds)
against the formats' own definitions: NumPy's and ml_dtypes' finfo, and gguf's block sizes
for llama.cpp's q8_0 and q4_0."""
import numpy as np
import pytest

from conftest import import_optional
from fastattn._storage import kinds as _kinds
from fastattn._storage import quant as _quant


def test_every_kind_has_one_row_in_number_order():
    assert [k["kind"] for k in _kinds.KINDS] == list(range(len(_kinds.KINDS)))
    assert len(_kinds.BY_NAME) == len(_kinds.KINDS)


def test_float_kinds_hold_their_formats_largest_values():
    assert _kinds.BY_NAME["float16"]["largest"] == float(np.finfo(np.float16).max)
    assert _kinds.BY_NAME["float32"]["largest"] == float(np.finfo(np.float32).max)
    ml_dtypes = import_optional("ml_dtypes")
    for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        dt = np.dtype(getattr(ml_dtypes, name))
        assert _kinds.BY_NAME[name]["largest"] == float(ml_dtypes.finfo(dt).max), name
        assert _kinds.of_dtype(dt) is _kinds.BY_NAME[name]


def test_block_formats_match_gguf():
    gguf = import_optional("gguf")
    for name, qtype in (("q8_0", gguf.GGMLQuantizationType.Q8_0),
                        ("q4_0", gguf.GGMLQuantizationType.Q4_0)):
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        k = _kinds.BY_NAME[name]
        assert k["block"] == block and k["scale"] == "float16 per block"
        # a float16 scale, then the block's values, per_item to a byte
        assert 2 + block // k["per_item"] == block_bytes, name


def test_dtypes_map_to_kinds_and_rows():
    assert _kinds.of_dtype(np.int8)["name"] == "q8_0"
    assert _kinds.of_dtype(np.uint8)["name"] == "q4_0"
    assert _kinds.of_dtype(np.float64) is None and _kinds.of_dtype(np.int16) is None
    assert _kinds.row_values(np.uint8, 16) == 32 and _kinds.row_values(np.int8, 16) == 16
    # A structured dtype that only shares a name with ml_dtypes' is no kind.
    assert _kinds.of_dtype(np.dtype([("bfloat16", np.uint16)])) is None
    assert _quant.cache_format(np.int8) == "q8_0" and _quant.cache_format(np.float16) is None


@pytest.mark.parametrize("name, levels", [("q8_0", 127), ("q4_0", 8)])
def test_block_formats_refuse_what_a_float16_scale_cannot_hold(name, levels):
    quantize = getattr(__import__("fastattn"), f"quantize_{name}")
    top = levels * float(np.finfo(np.float16).max)
    assert _kinds.BY_NAME[name]["quantisable"] == top
    quantize(np.full(32, top * 0.999, np.float32))
    with pytest.raises(ValueError, match="65504"):
        quantize(np.full(32, top * 1.01, np.float32))
