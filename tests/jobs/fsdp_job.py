"""A user's job that spreads its own model over the mesh the harness hands it (Knobs.mesh): FSDP2
on each decoder layer and the root, as torchtitan applies it."""

import torch

from harness.workload import Job, Knobs, hf_model


def build(k: Knobs) -> Job:
    from torch.distributed.fsdp import fully_shard

    model = hf_model("LlamaForCausalLM", k.dtype, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024)
    if k.mesh is not None:
        for layer in model.model.layers:
            fully_shard(layer, mesh=k.mesh)
        fully_shard(model, mesh=k.mesh)
    ids = torch.randint(0, 512, (k.batch_size, k.seq_len))
    return Job(model, torch.optim.AdamW(model.parameters()), ids,
               loss=lambda m, b: m(input_ids=b, labels=b, use_cache=False).loss)
