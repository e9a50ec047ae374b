"""Tiny target/draft pairs built from configs (no downloads), for Llama and GPT-2 architectures."""

from __future__ import annotations

import copy

import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)


def make_target(arch: str = "llama", vocab: int = 48, hidden: int = 64, layers: int = 2, seed: int = 0, ctx: int = 256,
                window: int = 5):
    """A tiny causal LM. ``mistral`` (every layer sliding), ``gemma2`` (sliding and full layers alternate) and
    ``qwen2`` (use_sliding_window, the first layer full) have a sliding window of ``window`` tokens."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=ctx, bos_token_id=0,
                  eos_token_id=1, pad_token_id=1, tie_word_embeddings=False)
    if arch == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=window, **common))
    elif arch == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config(sliding_window=window, head_dim=16, query_pre_attn_scalar=16,
                                               layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                                               **common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(sliding_window=window, use_sliding_window=True, max_window_layers=1,
                                             **common))
    elif arch == "llama":
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=ctx,
                          bos_token_id=0, eos_token_id=1, pad_token_id=1, tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg)
    elif arch == "gpt2":
        cfg = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=ctx,
                         bos_token_id=0, eos_token_id=1, pad_token_id=1, tie_word_embeddings=False)
        model = GPT2LMHeadModel(cfg)
    else:
        raise ValueError(arch)
    # sharpen the output so greedy margins are comfortable and samples are not uniform
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    return model.eval()


def noisy_copy(model, noise: float = 0.02, seed: int = 1):
    """A draft that mostly agrees with ``model``: the same weights plus Gaussian noise."""
    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * noise * (p.std() if p.numel() > 1 else 1.0))
    return draft.eval()


def make_pair(arch: str = "llama", noise: float = 0.3, **kw):
    target = make_target(arch, **kw)
    return target, noisy_copy(target, noise)
