"""Cost of one decoding round on a GPU, Qwen3-4B-shaped random weights (issue 10's GPU goals).

NOT MEASURED YET: the development machine has no GPU. Run this on one (an H200 for the anchors in
``../shared/notes/anchors-h200.md``: DDTree reference 3.3-4.0 ms non-forward overhead per round at
B = 64; HF eager 32.5 ms tree forward, 30.2 ms autoregressive step; StaticCache + compile 10.3 /
6.9 ms).

What it does: random bf16 weights of Qwen3-4B's shape (36 layers, hidden 2560, vocab 151936) and a
5-layer DFlash drafter (block 16), prompt of ``--prompt-len`` random tokens, ``--new-tokens`` new
tokens (random weights accept ~nothing, so this is cost per round, not speed-up), for each mode:

* ``eager``: the runtime as it ships (one host sync per round);
* ``graphs``: ``cuda_graphs=True`` (tree forward captured per (rows, nodes); capture time printed).

It prints ms per round of draft, build, tree_forward, verify, commit (``time_stages`` on: a CUDA
synchronise after each stage), ``overhead`` = build + verify + commit, and the autoregressive step
(method ``autoregressive``, same modes). Goals: overhead <= 0.5 ms, tree forward <= 7.5 ms, AR step
<= 6.9 ms with graph replay.

Usage::

    python benchmarks/gpu_round.py [--budget 64] [--prompt-len 1024] [--new-tokens 64] [--batch 1]
        [--output gpu_round.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_models(device, dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from sglang_tev.draft.dflash import DFlashConfig, DFlashDraftModel

    t = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
             num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
             tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        target = Qwen3ForCausalLM(Qwen3Config(**t)).to(dtype).eval()
        d = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=2560, intermediate_size=9728,
                 num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                 rope_theta=1000000.0, max_position_embeddings=40960, vocab_size=151936, block_size=16,
                 num_target_layers=36, dflash_config=dict(mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33]))
        draft = DFlashDraftModel(DFlashConfig.from_dict(d)).to(dtype).eval()
    return target, draft


def per_round(results):
    rounds = [x for r in results for x in r.rounds]
    ms = {k: sum(x.stage_ms.get(k, 0.0) for x in rounds) / len(rounds)
          for k in ("draft", "build", "tree_forward", "verify", "commit")}
    ms["overhead"] = ms["build"] + ms["verify"] + ms["commit"]
    return ms, len(rounds)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="GPU round cost, Qwen3-4B-shaped random weights (unmeasured here)")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_round.py needs a CUDA GPU; none is available", file=sys.stderr)
        return 2

    from sglang_tev.hf.drafters import DFlashDrafter
    from sglang_tev.hf.runtime import SpeculativeGenerator

    dev, dtype = torch.device("cuda"), torch.bfloat16
    target, draft = build_models(dev, dtype)
    prompts = [torch.randint(0, 150000, (args.prompt_len,)).tolist() for _ in range(args.batch)]
    out = {"meta": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
                    "budget": args.budget, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                    "batch": args.batch, "command": " ".join(sys.argv)}}
    for mode in ("eager", "graphs"):
        gen = SpeculativeGenerator(target, DFlashDrafter(draft, target), cuda_graphs=mode == "graphs")
        gen.time_stages = True
        for method in ("tev", "autoregressive"):
            kw = dict(method=method, budget=args.budget, max_new_tokens=args.new_tokens, ignore_eos=True)
            t0 = time.perf_counter()
            gen.generate(prompts if args.batch > 1 else prompts[0], **kw)  # warm-up (and capture)
            warm = time.perf_counter() - t0
            res = gen.generate(prompts if args.batch > 1 else prompts[0], **kw)
            res = res if isinstance(res, list) else [res]
            ms, rounds = per_round(res)
            rec = {"ms_per_round": {k: round(v, 3) for k, v in ms.items()}, "rounds": rounds,
                   "warmup_s": round(warm, 2), "graph_stats": gen.graph_stats}
            out[f"{mode}/{method}"] = rec
            print(f"{mode:7s} {method:15s}", json.dumps(rec), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
