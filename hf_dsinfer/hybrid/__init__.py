"""hf_dsinfer.hybrid"""
