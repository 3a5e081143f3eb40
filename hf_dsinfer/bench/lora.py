"""Mixed LoRA adapters in one engine against one merged model per adapter run in turn (issue 33, point 4).

``python -m hf_dsinfer.bench.lora --model smollm2 --adapters 4 --requests 64 --new-tokens 32 [--rounds N]
[--json out.json]`` (also ``hf-dsinfer bench --lora-mix``, ``--repeats`` rounds)

Both contenders serve the same requests (spread round-robin over the adapters and the base, random prompts, greedy,
no EOS stop):

* ``mixed``: one :class:`~hf_dsinfer.serving.ServingEngine` with ``enable_lora=True`` and every adapter loaded; all
  requests submitted at once, so each step mixes adapters (the gathered LoRA side path of ``kernels/lora.py``);
* ``merged``: for each adapter (and the base) a model with that adapter merged into its weights (peft's
  ``merge_and_unload``), loaded with the same inference config, serving only that adapter's requests; the adapters
  run one after another. Loading and merging are timed apart (``load_s``): a server switching models pays them too.
With ``--rounds N`` both run N times, alternating which goes first; every round is reported.

The adapters are random peft LoRAs (ranks 8, 16, 32, 64 in turn, on q/k/v/o/gate/up/down, non-zero B) unless
``--adapter-dirs`` names real ones. The report also counts requests whose greedy tokens agree between the two (merging
rounds the weights differently, so a near-tie may flip; this is a sanity check, not the exactness test, which is
tests/test_serving_lora.py against peft).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import torch

from .report import loadavg_text

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_random_adapters(base: str, out_dir: str, count: int, seed: int = 0) -> dict[str, str]:
    """``count`` random peft LoRA folders for the model at ``base`` (ranks 8, 16, 32, 64 in turn); ``{name: dir}``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dirs = {}
    for i in range(count):
        rank = (8, 16, 32, 64)[i % 4]
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
        g = torch.Generator().manual_seed(seed + i)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        path = os.path.join(out_dir, f"lora{i}-r{rank}")
        peft_model.save_pretrained(path)
        dirs[f"lora{i}"] = path
    return dirs


def _serve(engine: Any, work: list[tuple[list[int], str | None]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Submit every request at once, step until idle; (seconds, tokens per request)."""
    t0 = time.perf_counter()
    handles = [engine.submit(p, max_new_tokens=new_tokens, adapter=a) for p, a in work]
    engine.run_until_idle()
    return time.perf_counter() - t0, [h.result() for h in handles]


def run(base: str, adapters: dict[str, str], inference_config: dict, requests: int, prompt_len: int,
        new_tokens: int, seed: int = 0, rounds: int = 1) -> dict:  # fmt: skip
    """Both contenders on the same requests, ``rounds`` times, alternating which goes first; returns the report
    (every round's seconds and tokens/s per contender, the speed-up, greedy agreement)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    g = torch.Generator().manual_seed(seed)
    names: list[str | None] = [*adapters, None]
    vocab = AutoModelForCausalLM.from_pretrained(base, inference_config=inference_config).config.vocab_size
    work = [(torch.randint(3, vocab, (prompt_len,), generator=g).tolist(), names[i % len(names)])
            for i in range(requests)]  # fmt: skip
    greedy = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)
    tokens = requests * new_tokens
    rows = []
    for r in range(rounds):
        row: dict[str, Any] = {"round": r, "loadavg": loadavg_text()}
        outs = {}
        for contender in (("mixed", "merged_in_turn") if r % 2 == 0 else ("merged_in_turn", "mixed")):
            if contender == "mixed":
                secs, outs[contender] = _mixed(base, adapters, inference_config, work, names, greedy, new_tokens)
                row["mixed"] = {"seconds": secs, "tokens_per_s": tokens / secs}
            else:
                secs, load_s, outs[contender] = _merged(base, adapters, inference_config, work, names, greedy,
                                                        new_tokens)  # fmt: skip
                row["merged_in_turn"] = {"seconds": secs, "tokens_per_s": tokens / secs, "load_and_merge_s": load_s}
        row["speedup"] = row["merged_in_turn"]["seconds"] / row["mixed"]["seconds"]
        row["greedy_agreement"] = sum(a == b for a, b in zip(outs["mixed"], outs["merged_in_turn"])) / len(work)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return {
        "settings": {
            "model": base,
            "adapters": adapters,
            "requests": requests,
            "prompt_len": prompt_len,
            "new_tokens": new_tokens,
            "threads": torch.get_num_threads(),
            "rounds": rounds,
        },
        "rounds": rows,
    }


def _mixed(base, adapters, inference_config, work, names, greedy, new_tokens) -> tuple[float, list[list[int]]]:
    """One engine with every adapter loaded serving all requests at once: (seconds, tokens per request)."""
    from transformers import AutoModelForCausalLM

    from hf_dsinfer.serving import ServingEngine

    max_rank = max(json.load(open(os.path.join(d, "adapter_config.json")))["r"] for d in adapters.values())
    model = AutoModelForCausalLM.from_pretrained(base, inference_config=inference_config)
    engine = ServingEngine(model, enable_lora=True, max_loras=len(adapters), max_lora_rank=max_rank,
                           generation_config=greedy)  # fmt: skip
    for name, d in adapters.items():
        engine.load_lora_adapter(name, d)
    first = {a: p for p, a in reversed(work)}  # one request per adapter (and the base)
    _serve(engine, [(first[a], a) for a in names], 2)  # warm-up
    return _serve(engine, work, new_tokens)


def _merged(base, adapters, inference_config, work, names, greedy, new_tokens
            ) -> tuple[float, float, list[list[int]]]:  # fmt: skip
    """For each adapter (and the base) in turn, a model with it merged serving its requests: (serving seconds,
    loading and merging seconds, tokens per request)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_dsinfer.serving import ServingEngine

    merged_s, load_s, merged_out = 0.0, 0.0, [None] * len(work)
    for name in names:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            path = base
            if name is not None:
                ref = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
                PeftModel.from_pretrained(ref, adapters[name]).merge_and_unload().save_pretrained(tmp)
                path = tmp
            model = AutoModelForCausalLM.from_pretrained(path, inference_config=inference_config)
        engine = ServingEngine(model, generation_config=greedy)
        mine = [i for i, (_, a) in enumerate(work) if a == name]
        _serve(engine, [(work[mine[0]][0], None)], 2)  # warm-up
        load_s += time.perf_counter() - t0
        s, out = _serve(engine, [(work[i][0], None) for i in mine], new_tokens)
        merged_s += s
        for i, toks in zip(mine, out):
            merged_out[i] = toks
        del engine, model
    return merged_s, load_s, merged_out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="base model folder, or 'smollm2' (the offline real model)")
    p.add_argument("--adapter-dirs", nargs="*", help="peft LoRA folders (default: --adapters random ones)")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--rounds", type=int, default=1, help="runs of both contenders, alternating which goes first")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    from hf_dsinfer.real_model import resolve_model_name

    base = resolve_model_name(args.model)
    config = {"dtype": args.dtype, "max_out_tokens": args.prompt_len + args.new_tokens + 8}
    with tempfile.TemporaryDirectory() as tmp:
        if args.adapter_dirs:
            adapters = {os.path.basename(os.path.normpath(d)): d for d in args.adapter_dirs}
        else:
            adapters = make_random_adapters(base, tmp, args.adapters)
        report = run(base, adapters, config, args.requests, args.prompt_len, args.new_tokens, rounds=args.rounds)
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
