"""Quick start: load a model with an inference config, generate, and use DeepSpeed's init_inference.

Runs on CPU as written: a tiny random Llama stands in for a real checkpoint (no download needed).
Usage: python examples/quickstart.py (``time`` on the project's 2-core machine, 2026-11-25: 22 s with an empty torch
compile cache at a load average of ~4, 24-97 s at 6-14 with other jobs running; the first ``generate`` compiles the
CPU decode step).
"""

import tempfile

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_dsinfer


def main() -> None:
    path = tempfile.mkdtemp()
    config = LlamaConfig(
        vocab_size=500,
        hidden_size=96,
        intermediate_size=136,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)

    # 1. from_pretrained with an inference config (a dict, an InferenceConfig or a JSON path)
    model = AutoModelForCausalLM.from_pretrained(path, inference_config={"dtype": "fp32", "max_out_tokens": 256})
    ids = torch.tensor([[1, 5, 17, 42]])
    print("generate:", model.generate(ids, max_new_tokens=8, do_sample=False)[0].tolist())

    # 2. the config is saved with the model, which reloads optimized
    saved = tempfile.mkdtemp()
    model.save_pretrained(saved)
    print("reloaded config:", AutoModelForCausalLM.from_pretrained(saved).config.quantization_config.to_diff_dict())

    # 3. DeepSpeed's call on a model you already built, with per-forward timing
    engine = hf_dsinfer.init_inference(LlamaForCausalLM.from_pretrained(path), dtype="fp32")
    engine.profile_model_time()
    engine(input_ids=ids)
    print("forward ms:", engine.model_times())


if __name__ == "__main__":
    main()
