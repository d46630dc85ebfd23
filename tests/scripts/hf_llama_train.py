"""The training step of tests/jobs/hf_llama.py written as a plain script: the model built on the
host and moved, AdamW, readings of each step's peak. `python hf_llama_train.py batch seq`."""

import sys

import torch
import transformers

batch, seq = int(sys.argv[1]), int(sys.argv[2])
cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024)
cfg._attn_implementation = "sdpa"
model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).cuda()
opt = torch.optim.AdamW(model.parameters())
ids = torch.randint(0, 512, (batch, seq)).cuda()
for step in range(3):
    torch.cuda.reset_peak_memory_stats()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    del loss
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(f"step {step} peak {torch.cuda.max_memory_allocated()}")
