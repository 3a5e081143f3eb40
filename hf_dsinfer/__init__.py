"""hf_dsinfer: DeepSpeed-Inference-class speed for HuggingFace Transformers models (placeholder, filled below)."""
