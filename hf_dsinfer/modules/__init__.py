"""hf_dsinfer.modules"""
