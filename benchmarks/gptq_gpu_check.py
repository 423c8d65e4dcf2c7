"""GPTQ on the GPU: a random-weight model with Llama-3-8B layer shapes (2 layers), calibrated
on random token windows, quantized on the CPU and on the GPU; prints the times and how
many codes differ. The two runs do the same algorithm, but the Hessians, the Cholesky
factors and the error feedback round differently on each device, and GPTQ's sequential
error feedback turns such last-bit differences into different rounding decisions."""
import time

import torch
from transformers import LlamaConfig

from woq.kernels.format import QuantSpec
from woq.models.builder import QuantConfig, build_model
from woq.models.quant_linear import WeightOnlyLinear
from woq.models.quantize import gptq_model

config = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                     num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
g = torch.Generator().manual_seed(0)
from transformers import AutoModelForCausalLM  # noqa: E402

with torch.device("meta"):
    shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
state = {k: (torch.ones(s) if k.endswith("norm.weight") else torch.randn(s, generator=g) * 0.02) for k, s in shapes.items()}
windows = torch.randint(0, config.vocab_size, (16, 512), generator=g)
codes = {}
for device in ("cuda", "cpu"):
    model = build_model(config, dict(state), QuantConfig("none"), torch.float32, device, 512, progress=False)
    t0 = time.perf_counter()
    gptq_model(model, windows, QuantSpec(4, 128, False), act_order=True, progress=False)
    if device == "cuda":
        torch.cuda.synchronize()
    print(f"GPTQ int4 g128 act-order, 2 Llama-3-8B-shaped layers, 16x512 tokens, {device}: {time.perf_counter() - t0:.1f} s")
    codes[device] = [m.qweight.codes().cpu() for m in model.modules() if isinstance(m, WeightOnlyLinear)]
diff = sum(int((a != b).sum()) for a, b in zip(codes["cuda"], codes["cpu"]))
total = sum(a.numel() for a in codes["cpu"])
print(f"codes differing between GPU and CPU runs: {diff} of {total} ({100 * diff / total:.3f} %)")
