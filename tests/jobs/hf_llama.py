"""A transformers model by class, through the contract's helper."""

import torch

from harness.workload import Job, Knobs, hf_model


def build(k: Knobs) -> Job:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = hf_model("LlamaForCausalLM", k.dtype, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024)
    ids = torch.randint(0, 512, (k.batch_size, k.seq_len))
    return Job(model, torch.optim.AdamW(model.parameters()), ids,
               loss=lambda m, b: m(input_ids=b, labels=b, use_cache=False).loss, blocks=LlamaDecoderLayer)
