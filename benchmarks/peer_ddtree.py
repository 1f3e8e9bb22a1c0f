"""Side by side, in one process: the DDTree reference implementation and this runtime.

The reference is a checkout of https://github.com/liranringel/ddtree given with --ddtree-dir (it
is imported from there; nothing of it is copied into this repository). Both decode the same
prompts with the same target model object and the same DFlash drafter weights, at T = 0 and the
same budgets; the script checks the outputs are token-identical, then prints per-stage ms per
round, tokens/s and tau for both and the ratios.

Stages (ms per round = stage total / rounds, over all prompts):

=========  ===================================  =====================================
ours       reference (``ddtree_generate``)       what
=========  ===================================  =====================================
draft      draft                                the drafter forward (ours also projects
                                                the new context there in ``commit``)
build      tree_build + tree_compile            tree, mask, positions
(forward)  verify                               the target's tree forward
verify +   commit                               decision (argmax-follow / TEV) and KV
commit                                          compaction, features to the drafter
=========  ===================================  =====================================

``between`` = build + verify + commit (ours) vs tree_build + tree_compile + commit (reference):
everything but the two forwards. With ``--repeats R`` the whole interleaved sweep runs R times;
the table shows the median stage times, and the median over sweeps of each sweep's ratio (both
sides of a sweep saw the same machine load).

Usage::

    python benchmarks/peer_ddtree.py --ddtree-dir /path/to/ddtree [--budgets 16,64] [--prompts 10]
        [--max-new-tokens 128] [--threads 1] [--repeats 3] [--output results.json]

The reference needs ``loguru`` and ``datasets`` only for logging and dataset loading; when they
are missing, stand-ins are installed in ``sys.modules`` (this script uses neither). On a machine
without CUDA its ``cuda_time`` (which synchronises CUDA) is replaced by ``time.perf_counter``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_reference(ddtree_dir: str):
    """Import ``ddtree`` / ``dflash`` / ``model`` from the reference checkout."""
    for name in ("ddtree.py", "dflash.py", "model"):
        if not os.path.exists(os.path.join(ddtree_dir, name)):
            raise SystemExit(f"--ddtree-dir: {ddtree_dir!r} has no {name}; give a checkout of liranringel/ddtree")
    try:
        import loguru  # noqa: F401
    except ImportError:
        quiet = types.SimpleNamespace(info=lambda *a, **k: None, debug=lambda *a, **k: None, warning=print)
        sys.modules["loguru"] = types.SimpleNamespace(logger=quiet)
    try:
        import datasets  # noqa: F401
    except ImportError:
        stub = types.ModuleType("datasets")
        stub.load_dataset = stub.Features = stub.Sequence = stub.Value = None
        sys.modules["datasets"] = stub
    sys.path.insert(0, os.path.abspath(ddtree_dir))
    import ddtree as ref_ddtree
    import dflash as ref_dflash
    from model import DFlashDraftModel as RefDraft

    if not torch.cuda.is_available():
        ref_ddtree.cuda_time = ref_dflash.cuda_time = time.perf_counter
    return ref_ddtree, RefDraft


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--ddtree-dir", required=True, help="checkout of liranringel/ddtree")
    ap.add_argument("--target", default=None, help="target directory (None: the shipped tiny-code pair)")
    ap.add_argument("--draft", default=None, help="DFlash drafter directory (None: the shipped tiny-code pair)")
    ap.add_argument("--budgets", default="16,64", help="DDTree budgets, comma-separated")
    ap.add_argument("--prompts", type=int, default=10, help="first N HumanEval prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (EOS ignored)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (bf16 there)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="interleaved sweeps per budget; stage times and ratios are their medians")
    ap.add_argument("--output", default=None, help="write the records as JSON here")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",")]

    from sglang_tev.hf.datasets import encode_prompt, load_prompts
    from sglang_tev.hf.runtime import SpeculativeGenerator

    assets = os.path.join(ROOT, "sglang_tev", "assets", "tiny-code")
    target_dir = args.target or os.path.join(assets, "target")
    draft_dir = args.draft or os.path.join(assets, "draft")
    ref_ddtree, RefDraft = import_reference(args.ddtree_dir)

    dev = torch.device(args.device)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    gen = SpeculativeGenerator.from_pretrained(target_dir, draft_dir, dtype=dtype, device=dev)
    ref_draft = RefDraft.from_pretrained(draft_dir, dtype=dtype).to(dev).eval()
    mask_id = int(gen.drafter.model.mask_token_id)
    block = int(gen.drafter.block_size)
    prompts = [encode_prompt(p, gen.tokenizer) for p in load_prompts("humaneval", args.prompts)]

    def ours(ids, B):
        r = gen.generate(ids, method="tev", budget=B, max_new_tokens=args.max_new_tokens, ignore_eos=True)
        return r.token_ids, r.stage_ms(), [x.emitted for x in r.rounds], r.decode_s

    def reference(ids, B):
        x = torch.tensor([ids], device=dev)
        r = ref_ddtree.ddtree_generate(model=ref_draft, target=gen.target, input_ids=x, mask_token_id=mask_id,
                                       max_new_tokens=args.max_new_tokens, block_size=block, stop_token_ids=None,
                                       temperature=0.0, tree_budget=B)
        st = {k: v * 1e3 for k, v in r.stage_times.items()}
        decode_s = r.time_per_output_token * max(r.num_output_tokens, 1)
        # rounds = its acceptance lengths (tokens per round, bonus included); the prefill's token is
        # its first output token and no round's
        return r.output_ids[0, len(ids):].tolist(), st, r.acceptance_lengths, decode_s

    # warm-up (one-time costs land nowhere)
    ours(prompts[0][:32], budgets[0])
    reference(prompts[0][:32], budgets[0])

    def sweep(B):
        """One interleaved pass over the prompts at budget B: (record, texts identical)."""
        acc = {name: dict(st={}, per_round=[], toks=0, secs=0.0, outs=[]) for name in ("reference", "ours")}
        for i, ids in enumerate(prompts):  # interleaved, who goes first alternating: same machine load
            pair = (("reference", reference), ("ours", ours))
            for name, fn in (pair if i % 2 == 0 else pair[::-1]):
                a = acc[name]
                out, st, emitted, s = fn(ids, B)
                for k, v in st.items():
                    a["st"][k] = a["st"].get(k, 0.0) + v
                a["per_round"] += emitted
                a["toks"], a["secs"] = a["toks"] + len(out), a["secs"] + s
                a["outs"].append(out)
        agg = {}
        for name, a in acc.items():
            rounds = len(a["per_round"])
            agg[name] = dict(stage_ms={k: v / rounds for k, v in a["st"].items()}, rounds=rounds, tokens=a["toks"],
                             tokens_per_s=a["toks"] / a["secs"], outs=a["outs"], tau=sum(a["per_round"]) / rounds)
        # the reference emits its first token from the prefill; ours from round 1: same text
        same = all(a == b for a, b in zip(agg["reference"]["outs"], agg["ours"]["outs"]))
        r, o = agg["reference"], agg["ours"]
        rs, os_ = r["stage_ms"], o["stage_ms"]
        rec = {
            "reference": {"draft": rs["draft"], "build": rs["tree_build"] + rs["tree_compile"], "tree_forward": rs["verify"],
                          "decision_commit": rs["commit"], "between": rs["tree_build"] + rs["tree_compile"] + rs["commit"],
                          "tokens_per_s": r["tokens_per_s"], "tau": r["tau"]},
            "ours": {"draft": os_["draft"], "build": os_["build"], "tree_forward": os_["tree_forward"],
                     "decision_commit": os_["verify"] + os_["commit"], "between": os_["build"] + os_["verify"] + os_["commit"],
                     "tokens_per_s": o["tokens_per_s"], "tau": o["tau"]},
        }
        return rec, same

    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])

    records = []
    for B in budgets:
        runs = [sweep(B) for _ in range(args.repeats)]
        same = all(ok for _, ok in runs)
        keys = list(runs[0][0]["ours"])
        rec = {"budget": B, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "texts_identical": same,
               "repeats": args.repeats,
               "reference": {k: median([r["reference"][k] for r, _ in runs]) for k in keys},
               "ours": {k: median([r["ours"][k] for r, _ in runs]) for k in keys},
               # the ratio of each sweep (both sides saw the same load), then the median over sweeps
               "ratio_ours_over_reference": {k: median([r["ours"][k] / r["reference"][k] for r, _ in runs])
                                             for k in keys if all(r["reference"][k] for r, _ in runs)},
               "sweeps": [r for r, _ in runs]}
        records.append(rec)
        print(f"B={B}: texts identical at T=0: {same}" + (f" (median of {args.repeats} sweeps)" if args.repeats > 1 else ""))
        print(f"  {'stage (ms/round)':<18}{'reference':>11}{'ours':>10}{'ours/ref':>10}")
        for k in ("draft", "build", "tree_forward", "decision_commit", "between", "tokens_per_s", "tau"):
            a, b = rec["reference"][k], rec["ours"][k]
            print(f"  {k:<18}{a:>11.3f}{b:>10.3f}{rec['ratio_ours_over_reference'].get(k, float('nan')):>10.2f}")
    from sglang_tev.machine import machine_info

    meta = {**machine_info(machine="platform", processor="processor", cpu_count="cpu_count", python="python",
                           torch="torch"), "threads": args.threads,
            "device": str(dev), "dtype": str(dtype), "command": " ".join(sys.argv)}
    import transformers

    meta["transformers"] = transformers.__version__
    print(json.dumps(meta))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
    return 0 if all(r["texts_identical"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
