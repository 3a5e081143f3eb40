"""hf_dsinfer.generation"""
