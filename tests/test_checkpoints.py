"""GPTQ, the woq prepacked checkpoint, GPTQ/AWQ import, and clear errors on bad checkpoints."""
import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from conftest import tiny_hf_checkpoint
from quant_fixtures import awq_tensors, gptq_tensors, write_quantized_checkpoint
from woq.kernels import reference
from woq.kernels.format import QuantSpec, quantize
from woq.kernels.gptq import gptq_quantize
from woq.models.checkpoint import WEIGHTS, save_checkpoint
from woq.models.importers import CheckpointError
from woq.models.loader import load_model, read_checkpoint
from woq.models.quant_config import QuantConfig
from woq.models.quant_linear import WeightOnlyLinear
from woq.models.quantize import quantize_model

VOCAB = 49152


def _correlated_inputs(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)
    scale = torch.rand(k, generator=g) * 3 + 0.1  # uneven feature magnitudes: saliency
    return (torch.randn(n, k, generator=g) @ mix) * scale


@pytest.mark.parametrize("spec,act_order", [(QuantSpec(4, 64, False), False), (QuantSpec(4, 64, False), True),
                                            (QuantSpec(4, None, True), False), (QuantSpec(8, None, True), False)])
def test_gptq_reduces_output_error_versus_round_to_nearest(spec, act_order):
    g = torch.Generator().manual_seed(1)
    W = torch.randn(96, 256, generator=g) * 0.05
    X = _correlated_inputs(2048, 256)
    H = 2 * X.T @ X / X.shape[0]
    ref = X.double() @ W.double().T
    out = {}
    for name, qw in (("rtn", quantize(W, spec)), ("gptq", gptq_quantize(W, H, spec, act_order=act_order))):
        assert qw.codes().long().max() < (1 << spec.bits) and (qw.zeros is None) == spec.symmetric
        out[name] = ((X.double() @ reference.dequantize(qw, torch.float64).T - ref).norm() / ref.norm()).item()
    assert out["gptq"] < 0.8 * out["rtn"], out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir):
    path = tiny_hf_checkpoint(tmp_path_factory.mktemp("ck"), vocab_size=VOCAB, attention_bias=True)
    for f in smollm2_dir.glob("tokenizer*"):
        shutil.copy(f, path)
    return path


def _ids(seed=0):
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(seed))


def test_safetensors_are_read_as_the_builder_takes_them(tiny):
    """Opening a checkpoint reads no tensor; building the model reads each once, in the
    order the layers take them (never the whole weight up front)."""
    from woq.models.builder import build_model
    from woq.models.lazy_tensors import LazyTensors

    config, _, state, _ = read_checkpoint(tiny, None)
    assert isinstance(state, LazyTensors) and state.bytes_read == 0 and len(state) > 0
    stored = load_file(str(tiny / "model.safetensors"))
    order = []
    pop = state.pop
    state.pop = lambda name, *d: (order.append(name), pop(name, *d))[1]  # (this object's own pop: observed)
    build_model(config, state, QuantConfig("int4", 64, False), torch.float32, "cpu", 128, progress=False)
    assert len(state) == 0 and state.bytes_read == sum(t.numel() * t.element_size() for t in stored.values())
    taken = [n for n in order if n in stored]
    assert sorted(taken) == sorted(stored)  # each once
    first_of_layer_1 = min(i for i, n in enumerate(taken) if n.startswith("model.layers.1."))
    assert all(not n.startswith("model.layers.0.") for n in taken[first_of_layer_1:])  # layer by layer


def test_woq_checkpoint_loads_the_same_model_without_requantizing(tiny, tmp_path):
    quant = QuantConfig("int4", 64, False)
    direct = load_model(str(tiny), quant, device="cpu", max_seq_len=128, progress=False)
    config, tok, state, _ = read_checkpoint(tiny, None)
    model = quantize_model(config, state, tok, quant, "rtn", seq_len=128, progress=False)
    save_checkpoint(model, config, tok, tmp_path / "ck", str(tiny), {"method": "rtn"})
    loaded = load_model(str(tmp_path / "ck"), QuantConfig("int8"), device="cpu", max_seq_len=128, progress=False)
    layers = [m for m in loaded.model.modules() if isinstance(m, WeightOnlyLinear)]
    assert len(layers) == 4 * 3 and all(m.bits == 4 and m.group_size == 64 for m in layers)  # not re-quantized
    assert torch.equal(loaded.model(_ids()), direct.model(_ids()))
    with safe_open(str(tmp_path / "ck" / WEIGHTS), framework="pt") as f:
        meta = json.loads(f.metadata()["woq"])
    assert meta["format_version"] == 1 and meta["layout_version"] == 1 and meta["quantizer"] == {"method": "rtn"}
    # served under the source model's name, reported in the format it holds (not --quant's
    # int8 default), its weights as readable as its config
    assert loaded.name == tiny.name and loaded.quantization == "int4 g64 asym, rtn"
    ck = tmp_path / "ck"
    umask = os.umask(0)
    os.umask(umask)
    assert (ck / WEIGHTS).stat().st_mode & 0o777 == 0o666 & ~umask == (ck / "config.json").stat().st_mode & 0o777


def test_gptq_checkpoint_on_a_tiny_model_runs(tiny, tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"word{i % 97} token{i % 13}" for i in range(4000)))
    config, tok, state, _ = read_checkpoint(tiny, None)
    model = quantize_model(config, state, tok, QuantConfig("int4", 64, False), "gptq", act_order=True, calibration=text,
                           samples=8, seq_len=64, progress=False)
    save_checkpoint(model, config, tok, tmp_path / "gptq", str(tiny), {"method": "gptq"})
    loaded = load_model(str(tmp_path / "gptq"), device="cpu", max_seq_len=128, progress=False)
    logits = loaded.model(_ids())
    assert torch.isfinite(logits).all() and torch.equal(logits, model(_ids()))


LINEARS = [f"model.layers.{i}.{n}" for i in range(3) for n in
           ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")]


def _reference_logits(tiny, dense_weights: dict[str, torch.Tensor], ids):
    ref = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    sd = ref.state_dict()
    for name, w in dense_weights.items():
        sd[name + ".weight"] = w
    ref.load_state_dict(sd)
    with torch.no_grad():
        return ref(ids).logits


@pytest.mark.parametrize("bits,sym,act_order,v1", [(4, False, False, True), (4, True, False, True),
                                                   (8, True, False, True), (8, False, False, False),
                                                   (4, False, True, True)])
def test_gptq_checkpoint_import(tiny, tmp_path, bits, sym, act_order, v1):
    state = load_file(tiny / "model.safetensors")
    group = 32
    g = torch.Generator().manual_seed(bits)
    perms = {}
    tensors, dense = {}, {}
    for name in LINEARS:
        W = state[name + ".weight"]
        X = _correlated_inputs(256, W.shape[1], seed=len(name))
        qw = gptq_quantize(W, X.T @ X, QuantSpec(bits, group, sym))  # our GPTQ makes the fixture
        perm = None
        if act_order:  # one input order per input: q/k/v and gate/up share theirs
            key = (name.split(".")[2], W.shape[1], "o_proj" in name or "down_proj" in name)
            perm = perms.setdefault(key, torch.randperm(W.shape[1], generator=g))
        tensors[name] = gptq_tensors(qw, v1=v1, perm=perm)
        deq = reference.dequantize(qw)
        if perm is not None:
            scrambled = torch.empty_like(deq)
            scrambled[:, perm] = deq
            deq = scrambled
        dense[name] = deq
    qconfig = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": act_order,
               "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    ck = write_quantized_checkpoint(tiny, tmp_path / "gptq", tensors, qconfig)
    lm = load_model(str(ck), QuantConfig("int8"), device="cpu", max_seq_len=128, progress=False)
    layers = [m for m in lm.model.modules() if isinstance(m, WeightOnlyLinear)]
    assert len(layers) == 12 and all(m.bits == bits and m.group_size == group for m in layers)
    assert all((m.in_perm is not None) == act_order for m in layers)
    ids = _ids()
    ours, theirs = lm.model(ids), _reference_logits(tiny, dense, ids)
    assert (ours - theirs).abs().max() < 1e-4 * theirs.abs().max()


def test_awq_checkpoint_import(tiny, tmp_path):
    state = load_file(tiny / "model.safetensors")
    tensors, dense = {}, {}
    for name in LINEARS:
        qw = quantize(state[name + ".weight"], QuantSpec(4, 32, False))
        tensors[name], dense[name] = awq_tensors(qw), reference.dequantize(qw)
    qconfig = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    ck = write_quantized_checkpoint(tiny, tmp_path / "awq", tensors, qconfig)
    lm = load_model(str(ck), device="cpu", max_seq_len=128, progress=False)
    ids = _ids(1)
    ours, theirs = lm.model(ids), _reference_logits(tiny, dense, ids)
    assert (ours - theirs).abs().max() < 1e-4 * theirs.abs().max()


@pytest.mark.parametrize("method,bits,act_order", [("gptq", 4, False), ("gptq", 8, False), ("gptq", 4, True),
                                                    ("awq", 4, False)])
def test_a_share_of_an_imported_layer_is_the_whole_layers_slice(tmp_path, method, bits, act_order):
    """A tensor-parallel rank's share of a GPTQ/AWQ layer, read alone (``StoredImport``):
    rows that start inside a packed word, scattered rows, whole groups of columns and
    columns that cut a group equal the whole layer's, dequantized; act-order columns are
    refused (read whole)."""
    from woq.models.importers import StoredImport
    from woq.models.lazy_tensors import LazyTensors

    g = torch.Generator().manual_seed(bits)
    N, K, G = 40, 96, 32
    qw = quantize(torch.randn(N, K, generator=g), QuantSpec(bits, G, False))
    tensors = gptq_tensors(qw, perm=torch.randperm(K, generator=g) if act_order else None) \
        if method == "gptq" else awq_tensors(qw)
    qc = {"quant_method": method, "bits": bits, "group_size": G, "sym": False}
    save_file({f"layer.{k}": v for k, v in tensors.items()}, str(tmp_path / "layer.safetensors"))

    def stored() -> StoredImport:  # (a fresh read of the file each time: a share is taken once)
        return StoredImport(LazyTensors([tmp_path / "layer.safetensors"]), "layer", qc, K)

    whole = stored().read()
    dense = reference.dequantize(whole.weight).double()
    for rows in (torch.arange(13, 29), torch.tensor([1, 5, 6, 30, 39])):
        share = stored().read_rows(rows)
        assert torch.equal(reference.dequantize(share.weight).double(), dense[rows])
        assert (share.in_perm is None) == (whole.in_perm is None)
        assert share.in_perm is None or torch.equal(share.in_perm, whole.in_perm)
    for own in (range(32, 64), range(40, 72)):
        share = stored().read_columns(own)
        if act_order:
            assert share is None
            continue
        x = torch.randn(3, len(own), generator=g, dtype=torch.float64)
        mine = x if share.in_perm is None else x[:, share.in_perm]
        got = mine @ reference.dequantize(share.weight).double().T
        assert torch.allclose(got, x @ dense[:, own.start:own.stop].T, rtol=1e-12, atol=1e-12)


@pytest.fixture()
def woq_ck(tiny, tmp_path):
    config, tok, state, _ = read_checkpoint(tiny, None)
    model = quantize_model(config, state, tok, QuantConfig("int4", 64, False), "rtn", seq_len=128, progress=False)
    return save_checkpoint(model, config, tok, tmp_path / "ck", str(tiny), {"method": "rtn"})


def _rewrite(ck, edit_tensors=None, edit_meta=None):
    path = ck / WEIGHTS
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["woq"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if edit_tensors:
        edit_tensors(tensors)
    if edit_meta:
        edit_meta(meta)
    save_file(tensors, path, metadata={"woq": json.dumps(meta)})


QKV = "model.layers.1.self_attn.qkv_proj"
BAD = {
    "format version": (None, lambda m: m.update(format_version=99), "format version"),
    "missing tensor": (lambda t: t.pop(f"{QKV}.scales"), None, f"{QKV}.scales"),
    "wrong shape": (lambda t: t.update({f"{QKV}.packed": t[f"{QKV}.packed"][:-16]}), None, QKV),
    "wrong bits": (None, lambda m: m["linears"][QKV].update(bits=8), QKV),
    "missing norm": (lambda t: t.pop("model.layers.2.input_layernorm.weight"), None, "input_layernorm"),
    "config mismatch": (None, lambda m: m["linears"][QKV].update(out_features=64),
                        QKV),
}


@pytest.mark.parametrize("case", list(BAD))
def test_corrupt_or_mismatched_checkpoint_fails_naming_the_tensor(woq_ck, case):
    edit_t, edit_m, needle = BAD[case]
    if case == "config mismatch":  # a consistent tensor of the wrong size for the model
        def edit_t(t):
            t[f"{QKV}.packed"] = t[f"{QKV}.packed"][:64]
            t[f"{QKV}.scales"] = t[f"{QKV}.scales"][:64]
            t[f"{QKV}.zeros"] = t[f"{QKV}.zeros"][:64]
            t.pop(f"{QKV}.bias")
    _rewrite(woq_ck, edit_t, edit_m)
    with pytest.raises(CheckpointError, match=needle.replace(".", r"\.")):
        load_model(str(woq_ck), device="cpu", max_seq_len=128, progress=False)


def test_a_quantize_on_load_is_cached_and_read_back(tiny, tmp_path):
    """The first load quantizes and saves the result in the cache; the next load of the same
    model and quantization reads it (same logits, nothing quantized); another quantization,
    or a changed source file, is quantized anew."""
    from woq.kernels.options import RuntimeOptions

    options = RuntimeOptions(cache_dir=tmp_path / "cache")
    quant = QuantConfig("int4", 64, False)
    first = load_model(str(tiny), quant, device="cpu", max_seq_len=128, progress=False, options=options)
    entries = list((tmp_path / "cache" / "quantized").iterdir())
    assert not first.from_cache and len(entries) == 1 and (entries[0] / WEIGHTS).exists()
    again = load_model(str(tiny), quant, device="cpu", max_seq_len=128, progress=False, options=options)
    assert again.from_cache and again.name == first.name == tiny.name
    assert torch.equal(again.model(_ids()), first.model(_ids()))
    other = load_model(str(tiny), QuantConfig("int8"), device="cpu", max_seq_len=128, progress=False, options=options)
    assert not other.from_cache and len(list((tmp_path / "cache" / "quantized").iterdir())) == 2
    weights = next(tiny.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # "edited"
    edited = load_model(str(tiny), quant, device="cpu", max_seq_len=128, progress=False, options=options)
    assert not edited.from_cache and len(list((tmp_path / "cache" / "quantized").iterdir())) == 3


def test_unquantized_tensors_are_stored_in_the_asked_dtype(tiny, tmp_path):
    """`woq quantize` stores embeddings, norms and biases in the activations' dtype (fp16 by
    default) rather than the fp32 they were quantized in: the checkpoint shrinks, the codes
    and scales are the same bits, and the model computes what its fp32 twin does up to
    those tensors' rounding."""
    quant = QuantConfig("int4", 64, False)
    config, tok, state, _ = read_checkpoint(tiny, None)
    model = quantize_model(config, state, tok, quant, "rtn", seq_len=128, progress=False)
    save_checkpoint(model, config, tok, tmp_path / "f32", str(tiny), {"method": "rtn"})
    save_checkpoint(model, config, tok, tmp_path / "f16", str(tiny), {"method": "rtn"}, torch.float16)
    f32, f16 = (load_file(tmp_path / d / WEIGHTS) for d in ("f32", "f16"))
    assert f32.keys() == f16.keys()
    for name in f32:
        if name.endswith((".packed", ".scales", ".zeros")):
            assert f16[name].dtype == f32[name].dtype and torch.equal(f16[name], f32[name]), name
        else:
            assert f32[name].dtype == torch.float32 and f16[name].dtype == torch.float16, name
            assert torch.equal(f16[name], f32[name].half()), name
    assert (tmp_path / "f16" / WEIGHTS).stat().st_size < 0.75 * (tmp_path / "f32" / WEIGHTS).stat().st_size
    a, b = (load_model(str(tmp_path / d), device="cpu", max_seq_len=128, progress=False).model(_ids())
            for d in ("f32", "f16"))
    assert ((a - b).norm() / a.norm()).item() < 1e-2
