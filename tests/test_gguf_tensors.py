"""A GGUF file read tensor by tensor (``models/gguf_tensors.py``), against transformers' GGUF
loader (the whole file dequantized into an fp32 model) on the default model's file: Q4_1
linears, a Q8_0 embedding, F32 norms, architecture ``llama`` (q and k rows permuted by
llama.cpp's converter). Every tensor equals the reference's bit for bit, and a
tensor-parallel rank's shares -- rows of whole heads, columns cut mid-block -- equal the
reference's slices while reading only their blocks of the file. The file's config and
tokenizer, kept in the cache after a first parse, are the parsed ones."""
import os

import pytest
import torch

from woq.models import gguf_config_cache
from woq.models.gguf_tensors import GgufTensors

TEXTS = ["The capital of France is", "  two spaces, then\ttab\nand lines\n\n", "naïve café — 東京 🙂",
         "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x ** 2  # ok", "1234567890 3.14159", ""]


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoConfig, AutoModelForCausalLM

    from woq.models.fetch import fetch_default_gguf

    path = fetch_default_gguf()
    kw = dict(gguf_file=path.name, local_files_only=True)
    config = AutoConfig.from_pretrained(path.parent, **kw)
    # (given the config, transformers does not parse the file's metadata for it again)
    state = AutoModelForCausalLM.from_pretrained(path.parent, config=config, dtype=torch.float32, **kw).state_dict()
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


def test_kept_config_and_tokenizer_are_the_parsed_ones(reference):
    """The file's config and tokenizer kept in the cache (``models/gguf_config_cache.py``;
    the suite's cache, where the default model's conversion keeps them) have every field of
    the parsed config, and encode, decode and render the chat template as the parsed
    tokenizer does."""
    from transformers import AutoTokenizer

    from woq.kernels.options import default_cache_dir

    path, config, _ = reference
    cache = default_cache_dir()
    gguf_config_cache.config_and_tokenizer(path, cache)  # (kept by now, if the conversion had not)
    kept = gguf_config_cache.entry(path, cache)
    got_config, got_tokenizer = gguf_config_cache.config_and_tokenizer(path, cache)
    assert got_tokenizer.name_or_path == str(kept)  # (read from the entry, not the file)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    skip = {"_name_or_path", "transformers_version"}
    assert {k: v for k, v in got_config.to_dict().items() if k not in skip} == \
        {k: v for k, v in config.to_dict().items() if k not in skip}
    assert type(got_config) is type(config) and type(got_tokenizer) is type(tokenizer)
    assert got_tokenizer.get_vocab() == tokenizer.get_vocab() and len(got_tokenizer) == len(tokenizer)
    assert got_tokenizer.all_special_tokens == tokenizer.all_special_tokens
    assert (got_tokenizer.bos_token_id, got_tokenizer.eos_token_id) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert got_tokenizer(text)["input_ids"] == ids, text
        assert got_tokenizer.decode(ids) == tokenizer.decode(ids)
        assert got_tokenizer.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids, skip_special_tokens=True)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[2]},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": TEXTS[1]}]
    assert tokenizer.chat_template and got_tokenizer.chat_template == tokenizer.chat_template
    assert (got_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


def test_the_kept_config_and_tokenizer_follow_the_files_size_and_time(tmp_path):
    """An edited or replaced file is parsed anew: its entry's key holds its size and time."""
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    cache = tmp_path / "cache"
    first = gguf_config_cache.entry(path, cache)
    assert gguf_config_cache.entry(path, cache) == first and first.parent == cache / "gguf"
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    moved = gguf_config_cache.entry(path, cache)
    assert moved != first
    with open(path, "ab") as f:  # (same time, another size)
        f.write(b"\0")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert gguf_config_cache.entry(path, cache) not in (first, moved)
