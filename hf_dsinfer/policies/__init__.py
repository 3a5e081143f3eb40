"""hf_dsinfer.policies"""
