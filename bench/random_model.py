"""A random Llama of a given shape saved as an HF folder (no hub, no tokenizer): the second model of
the peer comparison (bench/peer_hf.py --model FOLDER), so speed is compared on more than the
bundled 7M-parameter model.

    python -m bench.random_model OUT [--preset llama30m]

llama30m: hidden 512, 8 layers, 8 heads / 4 kv heads (GQA), head_dim 64, SwiGLU 1408, vocab 8000,
untied embeddings, 1024 positions: 31.2M parameters. Weights are transformers' own random init
(seed 0), saved in float32.
"""
from __future__ import annotations

import argparse
from pathlib import Path

PRESETS = {
    "llama30m": dict(vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                     tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
}


def save_random_llama(out: str | Path, preset: str = "llama30m", seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**PRESETS[preset])).to(torch.float32)
    out = Path(out)
    model.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--preset", default="llama30m", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(save_random_llama(args.out, args.preset, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
