"""Every benchmark of hf_dsinfer, behind ``hf-dsinfer bench`` (the top layer: it may import everything else).

* :mod:`.decode`: ``generate`` speed, HF eager vs HF static cache + compile vs hf_dsinfer (the default mode), and the
  shape presets the other benchmarks share (``PRESETS``, ``preset_config``, ``preset_model``);
* :mod:`.encoder`: sentence embeddings (``--encoder``); :mod:`.lookup`: prompt lookup on the real SmolLM2
  (``--lookup``); :mod:`.hybrid`: generation inside a training loop (``--hybrid``);
* :mod:`.serving`: continuous batching in process against transformers' ``generate_batch`` (``--serve``);
* :mod:`.http_load` (requests, timing, figures), :mod:`.http_bench` (sweeps, report) and :mod:`.http_peers`: any
  OpenAI-compatible server over HTTP (``--serve-url``), or ours beside ``transformers serve`` and llama.cpp's server
  started on the same model (``--serve-peers``);
* :mod:`.report` and :mod:`.plots`: tables, JSON / markdown files and PNG plots; :mod:`.cli`: the command line.

The kernel benchmarks stay beside their kernels (``python -m hf_dsinfer.kernels.bench``,
``python -m hf_dsinfer.kernels.quant_cpu_bench``): ``kernels/`` may not import hf_dsinfer.

Nothing is imported here, so that ``import hf_dsinfer.bench.http_load`` stays free of torch.
"""
