"""The one-pass GGUF header reader (``models/gguf_header.py``) against gguf-py's
``GGUFReader`` on files gguf-py's ``GGUFWriter`` wrote: every scalar and string field, no
array, and every tensor's name, shape, type, size and mapped data."""
import numpy as np
import pytest

from woq.models.gguf_header import read_header


def _write(path, alignment: int) -> None:
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), arch="llama")
    w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -5)
    w.add_uint64("t.u64", 2**40 + 3)
    w.add_int64("t.i64", -(2**40))
    w.add_float32("t.f32", 0.1)
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.strings", ["a", "bé", "", "x" * 300])  # (the reader skips these)
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.nested", [[1, 2], [3, 4]])
    w.add_string("t.after_arrays", "still read")
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 3, 7)).astype(np.float16))
    w.add_tensor("i32", np.arange(9, dtype=np.int32))
    w.add_tensor("q8", quantize(rng.standard_normal((4, 64)).astype(np.float32), GGMLQuantizationType.Q8_0),
                 raw_dtype=GGMLQuantizationType.Q8_0)
    w.add_tensor("q4_1", quantize(rng.standard_normal((3, 96)).astype(np.float32), GGMLQuantizationType.Q4_1),
                 raw_dtype=GGMLQuantizationType.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [32, 64])
def test_fields_and_tensors_are_gguf_readers(tmp_path, alignment):
    from gguf import GGUFReader, GGUFValueType

    path = tmp_path / "t.gguf"
    _write(path, alignment)
    header, reader = read_header(path), GGUFReader(path)

    want = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or field.types[0] == GGUFValueType.ARRAY:
            continue
        value = field.parts[field.data[0]]
        want[key] = bytes(value).decode() if field.types[0] == GGUFValueType.STRING else value[0]
    assert header.fields == want
    assert header.fields["t.after_arrays"] == "still read" and header.fields["general.alignment"] == alignment
    assert not {"t.strings", "t.ints", "t.nested"} & set(header.fields)

    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for got, ref in zip(header.tensors, reader.tensors):
        assert got.shape == tuple(int(d) for d in ref.shape), got.name
        assert got.tensor_type == ref.tensor_type and got.n_bytes == int(ref.n_bytes), got.name
        assert got.data.dtype == ref.data.dtype and got.data.shape == ref.data.shape, got.name
        assert np.array_equal(got.data, ref.data), got.name


def test_what_is_not_a_whole_little_endian_gguf_is_refused(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="no GGUF magic"):
        read_header(bad)
    big = tmp_path / "big.gguf"
    big.write_bytes(b"GGUF" + (3).to_bytes(4, "big") + bytes(56))
    with pytest.raises(ValueError, match="big-endian"):
        read_header(big)
    cut = tmp_path / "cut.gguf"
    _write(cut, 32)
    cut.write_bytes(cut.read_bytes()[:200])  # (inside the metadata)
    with pytest.raises(ValueError, match="cut short"):
        read_header(cut)
