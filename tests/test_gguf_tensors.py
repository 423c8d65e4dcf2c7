"""A GGUF file read tensor by tensor (``models/gguf_tensors.py``), against transformers' GGUF
loader (the whole file dequantized into an fp32 model) on the default model's file: Q4_1
linears, a Q8_0 embedding, F32 norms, architecture ``llama`` (q and k rows permuted by
llama.cpp's converter). Every tensor equals the reference's bit for bit, and a
tensor-parallel rank's shares -- rows of whole heads, columns cut mid-block -- equal the
reference's slices while reading only their blocks of the file."""
import pytest
import torch

from woq.models.gguf_tensors import GgufTensors


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoConfig, AutoModelForCausalLM

    from woq.models.fetch import fetch_default_gguf

    path = fetch_default_gguf()
    kw = dict(gguf_file=path.name, local_files_only=True)
    config = AutoConfig.from_pretrained(path.parent, **kw)
    state = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kw).state_dict()
    return path, config, state


def test_every_tensor_is_transformers_dequantization(reference):
    from woq.models.gguf_header import read_header

    path, config, ref = reference
    tensors = GgufTensors(path, config)
    want = {n for n in ref if not (config.tie_word_embeddings and n == "lm_head.weight")}
    assert set(tensors.keys()) == want and len(tensors) == len(want)
    for name in list(tensors):
        assert tensors.shape(name) == list(ref[name].shape), name
        got = tensors.pop(name)
        assert got.dtype == torch.float32 and torch.equal(got, ref[name]), name
        assert name not in tensors  # (taken once)
    # (the header's sizes are gguf-py's: test_gguf_header.py)
    mapped = sum(t.n_bytes for t in read_header(path).tensors if t.name != "rope_freqs.weight")
    assert tensors.bytes_read == mapped


def test_a_ranks_shares_are_the_reference_slices_read_alone(reference):
    path, config, ref = reference
    tensors = GgufTensors(path, config)
    hd = config.hidden_size // config.num_attention_heads
    layer = "model.layers.3"
    q, k, o, down = (f"{layer}.self_attn.q_proj.weight", f"{layer}.self_attn.k_proj.weight",
                     f"{layer}.self_attn.o_proj.weight", f"{layer}.mlp.down_proj.weight")
    whole = GgufTensors(path, config)  # (what each whole tensor reads)
    full = {}
    for n in (q, o):
        before = whole.bytes_read
        whole.pop(n)
        full[n] = whole.bytes_read - before

    before = tensors.bytes_read
    assert torch.equal(tensors.pop_rows(q, slice(5 * hd, 9 * hd)), ref[q][5 * hd:9 * hd])  # heads 5..8
    assert tensors.bytes_read - before == full[q] * 4 // config.num_attention_heads
    # two runs of rows (KV heads 0 and 2), joined in order
    assert torch.equal(tensors.pop_rows(k, [slice(0, hd), slice(2 * hd, 3 * hd)]),
                       torch.cat([ref[k][:hd], ref[k][2 * hd:3 * hd]]))
    # columns cutting Q4_1 blocks of 32 at both ends: the blocks 96..320 read, cut to 100..300
    before = tensors.bytes_read
    assert torch.equal(tensors.pop_rows(o, None, slice(100, 300)), ref[o][:, 100:300])
    assert tensors.bytes_read - before == full[o] * (320 - 96) // config.hidden_size
    assert torch.equal(tensors.pop_rows(down, None, slice(768, 1536)), ref[down][:, 768:1536])
    embed = "model.embed_tokens.weight"  # (Q8_0)
    assert torch.equal(tensors.pop_rows(embed, slice(1000, 2000)), ref[embed][1000:2000])
    with pytest.raises(ValueError, match="cut a head"):
        tensors.pop_rows(f"{layer}.self_attn.q_proj.weight".replace(".3.", ".4."), slice(10, 10 + hd))
