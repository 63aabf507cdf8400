#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""tierkv from Python: a transformers model generating through a tiered KV cache.

A tiny random-weight Qwen3 (so it runs anywhere in seconds) generates greedily through
tierkv.transformers.TieredCache, with int8_rotated Recent/Anchor pages and TQ4 keys / TQ3 values
in Stale pages, on the CPU (the host ops) and, where a GPU and libtierkv_cuda.so are present, on
the GPU (tierkv.CudaCache). It prints the cache's memory report and checks, against the dense
model teacher-forced on the generated tokens, that at least 3 in 4 tokens are its own choice and
every token is in its top 3 (the cache's error may flip a near tie, not pick an unlikely token),
and that the tiered cache holds fewer than 8 bits per scalar. Exit 1 if a check fails. Run after `pip install --no-build-isolation ./python`.
"""
import sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import tierkv
from tierkv.transformers import TieredCache


def main() -> int:
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                      max_position_embeddings=1024, attn_implementation="tierkv")  # fmt: skip
    model = Qwen3ForCausalLM(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (2, 200))
    devices = ["cpu"]
    if torch.cuda.is_available() and tierkv.cuda.library_path().is_file():
        devices.append("cuda")
    ok = True
    for device in devices:
        model.to(device)
        cache = TieredCache(model.config, device=device, max_tokens=512, page_size=16, recent_pages=2,
                            keep_first_layers=0, keep_last_layers=0, min_dwell_steps=0)  # fmt: skip
        with torch.no_grad():
            out = model.generate(prompt.to(device), attention_mask=torch.ones_like(prompt).to(device),
                                 past_key_values=cache, max_new_tokens=24, do_sample=False,
                                 pad_token_id=0)  # fmt: skip
        new = out[:, prompt.shape[1] :].cpu()
        # the dense model's logits for the same tokens: one teacher-forced pass, no cache
        model.config._attn_implementation = "sdpa"
        with torch.no_grad():
            logits = model(input_ids=out[:, :-1]).logits[:, prompt.shape[1] - 1 :].float().cpu()
        model.config._attn_implementation = "tierkv"
        chosen = logits.gather(-1, new.unsqueeze(-1))
        rank = (logits > chosen).sum(-1)  # 0: the dense model's own choice
        same, top3 = (rank == 0).float().mean().item(), (rank < 3).float().mean().item()
        report = cache.tierkv.report()
        print(f"[{device}] generated {tuple(new.shape)}: {new[0, :12].tolist()} ...")
        print(f"[{device}] dense model's choice {same:.0%}, in its top 3 {top3:.0%}; "
              f"{report['bits_per_scalar']:.2f} bits per scalar, {report['kib_per_token']:.2f} KiB per token, "
              f"tiers {[t['live_pages'] for t in report['tiers']]} live pages")
        ok = ok and same >= 0.75 and top3 == 1.0 and report["bits_per_scalar"] < 8
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
