"""Tensor-parallel generation: ``torchrun --nproc_per_node 2 examples/tp_generate.py [model_dir]``.

Without a model directory, rank 0 saves a tiny random Llama (GQA: 6 q heads, 2 kv heads) to a temporary directory
first, so the example runs anywhere, on CPU with gloo. Each rank reads only its slices of the weights, generates,
and every rank prints the same text. See docs/tensor_parallel.md.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import transformers

import hf_dsinfer  # noqa: F401  (adds inference_config= to from_pretrained)
from hf_dsinfer.parallel import init_distributed


def save_tiny_llama(directory: str) -> None:
    """A random 2-layer Llama with a byte-level tokenizer (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["Tensor parallelism splits every layer over the ranks."] * 10, trainer=trainer)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                         padding_side="left").save_pretrained(directory)


def main() -> None:
    if not init_distributed():
        sys.exit("start with torchrun, e.g. `torchrun --nproc_per_node 2 examples/tp_generate.py`")
    world, rank = dist.get_world_size(), dist.get_rank()
    if len(sys.argv) > 1:
        path = sys.argv[1]
    else:
        holder = [tempfile.mkdtemp(prefix="tp_generate_") if rank == 0 else None]
        dist.broadcast_object_list(holder, src=0)  # every rank uses rank 0's directory
        path = holder[0]
        if rank == 0:
            save_tiny_llama(path)
        dist.barrier()

    dtype = "bf16" if torch.cuda.is_available() else "fp32"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path,
        inference_config={"dtype": dtype, "tensor_parallel": {"tp_size": world}, "replace_with_kernel_inject": True},
    )
    tok = transformers.AutoTokenizer.from_pretrained(path)
    batch = tok(["Tensor parallelism", "every layer"], return_tensors="pt", padding=True).to(model.device)
    torch.manual_seed(rank)  # differs per rank on purpose: generate() broadcasts rank 0's RNG state first
    out = model.generate(**batch, max_new_tokens=16, do_sample=True, pad_token_id=tok.pad_token_id)
    local = sum(p.numel() for p in model.parameters())
    text = tok.batch_decode(out[:, batch.input_ids.shape[1]:])
    print(f"[rank {rank}/{world}] {local} parameters here; sampled: {text}")
    if rank == 0 and len(sys.argv) == 1:
        import shutil

        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()  # nobody tears the group down while a peer still talks
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
