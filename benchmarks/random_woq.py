"""A random-weight model written straight as a woq int4 g128 checkpoint: a 70B-shaped model
(about 39 GB) without its 140 GB of fp16 weights to quantize first. Every quantized layer
holds random codes, fp16 scales and zero points in the logical format (``kernels/format.py``),
the embedding and the LM head random fp16, the norms ones. Loaded with
``--tensor-parallel-size N``, each rank reads only its share of every layer
(``models/checkpoint.py``, ``StoredLinear``).

    python benchmarks/random_woq.py --config llama3-70b --out /tmp/llama3-70b-woq
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def configs() -> dict:
    from transformers import LlamaConfig

    from engine import configs as engine_configs

    llama70b = LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                           num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
                           rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                           tie_word_embeddings=False)
    return {**engine_configs(), "llama3-70b": llama70b}


def write_random_woq(config, directory: Path, tokenizer: Path, group: int = 128, seed: int = 0) -> Path:
    """``config``'s model as a woq checkpoint in ``directory`` (with ``tokenizer``'s files)."""
    from safetensors.torch import save_file

    from woq.kernels.layout import LAYOUT_VERSION
    from woq.models.checkpoint import FORMAT_VERSION, WEIGHTS

    if (directory / WEIGHTS).exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    # (drawn on the GPU where there is one: a 70B model holds some 35 G random codes)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device).manual_seed(seed)
    H, inter, V = config.hidden_size, config.intermediate_size, config.vocab_size
    D = getattr(config, "head_dim", None) or H // config.num_attention_heads
    shapes = {"self_attn.qkv_proj": ((config.num_attention_heads + 2 * config.num_key_value_heads) * D, H),
              "self_attn.o_proj": (H, config.num_attention_heads * D), "mlp.gate_up_proj": (2 * inter, H),
              "mlp.down_proj": (H, inter)}
    tensors, linears = {}, {}

    def dense(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * 0.02).to(torch.float16).cpu()

    for i in range(config.num_hidden_layers):
        for name, (N, K) in shapes.items():
            full = f"model.layers.{i}.{name}"
            groups = -(-K // group)
            tensors[f"{full}.packed"] = torch.randint(0, 256, (N, -(-K // 2)), generator=g, dtype=torch.uint8,
                                                      device=device).cpu()
            # (codes 0..15 around zero points 0..15: weights of about 0.02 x 15 / 2 at most)
            tensors[f"{full}.scales"] = (torch.rand(N, groups, generator=g, device=device) * 0.002
                                         + 0.001).to(torch.float16).cpu()
            tensors[f"{full}.zeros"] = torch.randint(0, 16, (N, groups), generator=g, dtype=torch.uint8,
                                                     device=device).cpu()
            linears[full] = {"bits": 4, "group_size": group, "in_features": K, "out_features": N, "symmetric": False}
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{norm}.weight"] = torch.ones(H, dtype=torch.float16)
    tensors["model.embed_tokens.weight"] = dense(V, H)
    tensors["model.norm.weight"] = torch.ones(H, dtype=torch.float16)
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = dense(V, H)
    meta = {"format": "woq", "format_version": FORMAT_VERSION, "layout_version": LAYOUT_VERSION,
            "source_model": directory.name, "quantizer": {"method": "random"}, "linears": linears}
    save_file(tensors, str(directory / WEIGHTS), metadata={"woq": json.dumps(meta)})
    config.torch_dtype = torch.float16
    config.save_pretrained(directory)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tokenizer / f).exists():
            shutil.copy(tokenizer / f, directory / f)
    return directory


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="llama3-70b", choices=sorted(configs()))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokenizer", type=Path, default=Path(".tok"), help="a directory with the tokenizer files")
    a = p.parse_args()
    print(write_random_woq(configs()[a.config], a.out, a.tokenizer))


if __name__ == "__main__":
    main()
