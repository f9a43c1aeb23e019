"""The engine's float32 LM head (EngineSettings.fp32_lm_head): a bf16 model's logits are computed as
linear(hidden.float(), weight.float()), the learner's computation, not rounded to bf16."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

from services.engine.kv_batch import BatchKV, KVShape, forward_columns


def tiny_bf16_qwen2():
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        model.model.norm.weight.fill_(40.0)  # logits of magnitude ~10, where bf16 rounds by ~0.03
    return model


def test_fp32_lm_head_gives_float32_logits_of_the_bf16_hidden_state():
    model = tiny_bf16_qwen2()
    ids = torch.tensor([[5, 9, 17, 33, 2]])
    positions = torch.arange(5)[None]
    valid = torch.ones(1, 5, dtype=torch.bool)
    fp32 = forward_columns(
        model, BatchKV(KVShape.of(model), 1, 0), ids, positions, valid, fp32_lm_head=True
    )
    bf16 = forward_columns(
        model, BatchKV(KVShape.of(model), 1, 0), ids, positions, valid, fp32_lm_head=False
    )
    with torch.no_grad():
        hidden = model.model(input_ids=ids, position_ids=positions).last_hidden_state[:, -1]
        reference = F.linear(hidden.float(), model.lm_head.weight.float())
    assert fp32.dtype == bf16.dtype == torch.float32
    assert torch.allclose(fp32, reference, atol=1e-3)
    assert torch.equal(bf16, bf16.bfloat16().float())  # the default head's logits are bf16 values
    assert not torch.equal(fp32, fp32.bfloat16().float())  # these are not
    assert (fp32 - bf16).abs().max() > 1e-3
