#!/usr/bin/env python
"""What reading the drafter's context features costs in one target forward (batch 1, one token).

Three ways over the same module, in alternating blocks in one process (a VM's speed drifts
between minutes; the blocks share them): no features; ``output_hidden_states=True`` (transformers
5 hooks every decoder layer and keeps every layer's output); the runtime's ``LayerTaps`` (hooks on
the drafter's few layers only, ``sglang_tev/hf/target.py``). The module's hooks are swapped between
blocks, so each way runs with only its own hooks installed. Prints the median and mean ms per
forward of each.

    python benchmarks/feature_taps.py [--cycles 25] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=25, help="blocks per way")
    p.add_argument("--block", type=int, default=40, help="forwards per block (the first 5 not timed)")
    p.add_argument("--context", type=int, default=300, help="tokens in the KV cache")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)

    import torch
    from transformers import DynamicCache

    from sglang_tev.hf.runtime import SpeculativeGenerator
    from sglang_tev.hf.target import LayerTaps, TargetModel

    if args.threads:
        torch.set_num_threads(args.threads)
    gen = SpeculativeGenerator.from_pretrained()
    module = gen._target.module
    lids = tuple(gen.drafter.target_layer_ids)
    tm = TargetModel(module)
    cache = DynamicCache(config=module.config)
    with torch.inference_mode():
        module(torch.randint(0, 1000, (1, args.context)), past_key_values=cache, use_cache=True,
               output_hidden_states=True)  # installs transformers' hooks once
        hf_hooks = {id(m): dict(m._forward_hooks) for m in module.modules()}
        for m in module.modules():
            m._forward_hooks.clear()
        taps = LayerTaps.attach(module, lids)
        if taps is None:
            raise SystemExit(f"LayerTaps cannot serve layers {lids} of this target")
        tap_hooks = {id(m): dict(m._forward_hooks) for m in module.modules()}

    def install(way):
        for m in module.modules():
            m._forward_hooks.clear()
            m._forward_hooks.update({"hf": hf_hooks, "taps": tap_hooks}.get(way, {}).get(id(m), {}))

    x, pos = torch.randint(0, 1000, (1, 1)), torch.tensor([[args.context]])
    ways = {"none": None, "hf": lids, "taps": lids}
    times = {w: [] for w in ways}
    with torch.inference_mode():
        for _ in range(args.cycles):
            for way, ids in ways.items():
                install(way)
                tm._taps[lids] = taps if way == "taps" else None  # None: output_hidden_states
                for i in range(args.block):
                    t0 = time.perf_counter()
                    tm.forward(x, pos, None, cache, ids)
                    if i >= 5:
                        times[way].append(time.perf_counter() - t0)
                    cache.crop(-1)
    install("taps")
    print(f"target layers {lids}, {args.cycles} blocks of {args.block - 5} timed forwards per way")
    for way, ts in times.items():
        print(f"  {way:5s} median {statistics.median(ts) * 1e3:.3f} ms  mean {statistics.mean(ts) * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
