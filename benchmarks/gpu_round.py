"""Cost of one decoding round on a GPU, Qwen3-4B-shaped random weights (issue 10's GPU goals).

NOT MEASURED YET: the development machine has no GPU. ``scripts/gpu_check.py`` runs these
functions (and the correctness checks first) in one command; or run this on one (an H200 for the anchors in
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
import sys
import time

import torch



QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                rms_norm_eps=1e-6, tie_word_embeddings=True, attn_implementation="sdpa")
"""Qwen3-4B's shape (the anchors' target)."""

DFLASH_QWEN3_4B = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=2560, intermediate_size=9728,
                       num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960, vocab_size=151936,
                       block_size=16, num_target_layers=36,
                       dflash_config=dict(mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33]))
"""z-lab's Qwen3-4B DFlash drafter's shape (5 layers, block 16)."""

SHAPES = {
    "qwen3-4b": (QWEN3_4B, DFLASH_QWEN3_4B),
    # a few-MB pair of the same architecture: scripts/gpu_check.py --dry-run runs this file's code on CPU with it
    "tiny": (dict(QWEN3_4B, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512),
             dict(DFLASH_QWEN3_4B, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, vocab_size=256, block_size=4,
                  num_target_layers=2, dflash_config=dict(mask_token_id=255, target_layer_ids=[0, 1]))),
}


def build_models(device, dtype, shape: str = "qwen3-4b"):
    """Random-weight target (Qwen3ForCausalLM) and DFlash drafter of ``SHAPES[shape]`` on ``device``
    in ``dtype`` (seed 0), both in eval mode."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from sglang_tev.draft.dflash import DFlashConfig, DFlashDraftModel

    t, d = SHAPES[shape]
    torch.manual_seed(0)
    with torch.device(device):
        target = Qwen3ForCausalLM(Qwen3Config(**t)).to(dtype).eval()
        draft = DFlashDraftModel(DFlashConfig.from_dict(d)).to(dtype).eval()
    return target, draft


def random_prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    """``batch`` prompts of ``length`` random ids below min(150000, vocab - 1) (clear of the
    special and mask ids), from torch's global generator."""
    return [torch.randint(0, min(150000, vocab - 1), (length,)).tolist() for _ in range(batch)]


def per_round(results):
    """Mean ms per round of each stage over the rounds of ``results``, plus ``overhead`` (build +
    verify + commit: everything but the two forwards) and ``total`` (every stage: for the
    autoregressive method, one decoding step). Returns (ms dict, rounds)."""
    rounds = [x for r in results for x in r.rounds]
    ms = {k: sum(x.stage_ms.get(k, 0.0) for x in rounds) / len(rounds)
          for k in ("draft", "build", "tree_forward", "verify", "commit")}
    ms["overhead"] = ms["build"] + ms["verify"] + ms["commit"]
    ms["total"] = ms["draft"] + ms["tree_forward"] + ms["overhead"]
    return ms, len(rounds)


def measure(gen, prompts, method: str, budget: int, new_tokens: int, sampling=None) -> dict:
    """One warm-up call (CUDA-graph captures happen there) and one measured call of
    ``gen.generate`` with EOS ignored; stage times need ``gen.time_stages`` on CUDA.

    Returns:
        {"ms_per_round": per_round's ms (3 decimals), "rounds", "tau", "warmup_s", "graph_stats"}.
    """
    kw = dict(method=method, budget=budget, max_new_tokens=new_tokens, ignore_eos=True, sampling=sampling)
    arg = prompts if len(prompts) > 1 else prompts[0]
    t0 = time.perf_counter()
    gen.generate(arg, **kw)  # warm-up (and capture)
    warm = time.perf_counter() - t0
    res = gen.generate(arg, **kw)
    res = res if isinstance(res, list) else [res]
    ms, rounds = per_round(res)
    return {"ms_per_round": {k: round(v, 3) for k, v in ms.items()}, "rounds": rounds,
            "tau": round(sum(len(r.token_ids) for r in res) / rounds, 3), "warmup_s": round(warm, 2),
            "graph_stats": dict(gen.graph_stats) if gen.graph_stats else None}


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
    from sglang_tev.machine import machine_info

    dev, dtype = torch.device("cuda"), torch.bfloat16
    target, draft = build_models(dev, dtype)
    prompts = random_prompts(args.batch, args.prompt_len, target.config.vocab_size)
    out = {"meta": {**machine_info("gpu", "torch", "python"),
                    "budget": args.budget, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                    "batch": args.batch, "command": " ".join(sys.argv)}}
    for mode in ("eager", "graphs"):
        gen = SpeculativeGenerator(target, DFlashDrafter(draft, target), cuda_graphs=mode == "graphs")
        gen.time_stages = True
        for method in ("tev", "autoregressive"):
            rec = measure(gen, prompts, method, args.budget, args.new_tokens)
            out[f"{mode}/{method}"] = rec
            print(f"{mode:7s} {method:15s}", json.dumps(rec), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
