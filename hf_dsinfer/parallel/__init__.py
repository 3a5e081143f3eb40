"""hf_dsinfer.parallel"""
