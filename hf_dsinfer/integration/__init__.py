"""hf_dsinfer.integration"""
