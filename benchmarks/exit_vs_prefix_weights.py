"""How different are ExitTrain's exit weights w(v) = P(v)·rho(v) and the prefix control's weights
(P(v) rescaled to the same total) on a drafter's real trees? (docs/exittrain.md, loss options.)

For every position of the target's own continuations cached by ``sglang-tev eval-drafter``
(``--cache-dir`` / ``OUTPUT/continuations``), the drafter's DDTree at budget B and the exit law under
the continuation's temperature: the total variation between the two weight vectors (each divided
by its total 1 - w(root); positions with no non-root mass skipped), and per prompt the cosine
between the two exit-loss gradients with respect to the draft logits.

    sglang-tev eval-drafter --prompts humaneval --limit 24 --temperatures 0,1 --output runs/ev
    python benchmarks/exit_vs_prefix_weights.py --cache runs/ev/continuations --budget 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
ASSET = REPO / "sglang_tev" / "assets" / "tiny-code"


def main(argv=None) -> int:
    from transformers import DynamicCache

    from sglang_tev.draft.dflash import DFlashDraftModel, extract_context_features
    from sglang_tev.hf.runtime import cache_kwargs
    from sglang_tev.train.drafter_eval import laws_by_temperature
    from sglang_tev.train.exit import anchor_trees, kv_reuse_forward, weights_from_law
    from sglang_tev.train.losses import block_logits, exit_loss
    from sglang_tev.train.trainer import load_target

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", type=Path, required=True, help="an eval-drafter continuations directory")
    p.add_argument("--target", type=Path, default=ASSET / "target")
    p.add_argument("--draft", type=Path, default=ASSET / "draft-base",
                   help="default: the drafter before ExitTrain, which docs/exittrain.md measured")
    p.add_argument("--budget", type=int, default=64)
    args = p.parse_args(argv)
    files = sorted(args.cache.glob("continuations-T*.jsonl"))
    if not files:
        p.error(f"argument --cache: no continuations-T*.jsonl in {args.cache}")
    torch.set_num_threads(1)
    target, _ = load_target(args.target, torch.device("cpu"), torch.float32)
    d = DFlashDraftModel.from_pretrained(args.draft, dtype=torch.float32).eval()
    K = d.config.block_size
    dec, emb, head = target.get_decoder(), target.get_input_embeddings(), target.get_output_embeddings()
    t0 = time.time()
    for f in files:
        T = float(f.name.split("-")[1][1:])
        tvs, cos = [], []
        for r in map(json.loads, open(f)):
            x = torch.tensor([r["prompt_ids"] + r["response_ids"]])
            anchors = torch.arange(len(r["prompt_ids"]) - 1, x.shape[1] - 1)[None]
            keep = torch.ones_like(anchors, dtype=torch.bool)
            with torch.no_grad():
                cache = DynamicCache()
                out = dec(input_ids=x, output_hidden_states=True, use_cache=True, **cache_kwargs(dec, cache))
                feats = extract_context_features(out.hidden_states, d.config.target_layer_ids)
                lg, _ = block_logits(d.forward_train, emb, head, feats, x, anchors, keep, K, d.config.mask_token_id)
            z = lg.reshape(-1, K - 1, lg.shape[-1])
            tree = anchor_trees(z, args.budget, x.gather(1, anchors).reshape(-1))
            law, = laws_by_temperature(kv_reuse_forward(dec, cache), head, out.last_hidden_state, tree, anchors, [T])
            we, wp = weights_from_law(tree, law, "exit"), weights_from_law(tree, law, "prefix")
            W = we.sum(1)
            ok = W > 1e-6
            tvs += (0.5 * (we - wp).abs().sum(1)[ok] / W[ok]).tolist()
            zz = z.detach().clone().requires_grad_()
            ge, = torch.autograd.grad(exit_loss(zz, tree, we).numerator, zz)
            gp, = torch.autograd.grad(exit_loss(zz, tree, wp).numerator, zz)
            cos.append(float(torch.nn.functional.cosine_similarity(ge.flatten(), gp.flatten(), dim=0)))
        tv = torch.tensor(tvs)
        print(f"T={T:g} B={args.budget}: {len(tvs)} positions, TV(exit, prefix) mean {tv.mean():.3f} median "
              f"{tv.median():.3f}; gradient cosine (draft logits) per prompt mean {sum(cos) / len(cos):.3f} "
              f"(min {min(cos):.3f}, max {max(cos):.3f}, {len(cos)} prompts)")
    print(f"wall {time.time() - t0:.0f} s (1 thread)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
