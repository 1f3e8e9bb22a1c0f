"""Records every TEV round's decision in each SGLang scheduler process (tests only; an observer,
not a stand-in: nothing it wraps changes behaviour).

With ``SGLANG_TEV_TP_TRACE=<folder>`` (and the harness on ``PYTHONPATH``, as ``sitecustomize``
loads this module), ``sglang_tev.srt.worker.commit_outputs`` and ``TEVWorker._plain_step`` (a plain
step that builds no tree: recorded as its root-only trees) are wrapped right after the worker
module is imported: each round appends one JSON line to ``<folder>/rank<R>.jsonl``, where R is the
process's ``torch.distributed`` rank (0 without a process group). So a ``--tp-size 2`` Engine
leaves one file per TP rank, and a test can compare the ranks' decisions round by round.

A line: ``{"seq_lens": [bs], "parents": [bs][N], "tokens": [bs][N], "exit_node": [bs],
"bonus": [bs], "commit_lens": [bs]}`` (ints), in call order.
"""

from __future__ import annotations

import json
import os

from sglang_tev import env as tev_env

ENV = tev_env.TP_TRACE


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _wrap_worker(mod) -> None:
    folder = tev_env.get(ENV)
    orig = mod.commit_outputs

    orig_plain = mod.TEVWorker._plain_step

    def write(line: dict) -> None:
        with open(os.path.join(folder, f"rank{_rank()}.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")

    def commit_outputs(tree, out, seq_lens):
        plan = orig(tree, out, seq_lens)
        write(dict(
            seq_lens=seq_lens.tolist(),
            parents=tree.parents.tolist(),
            tokens=tree.tokens.tolist(),
            exit_node=out.exit_node.tolist(),
            bonus=out.bonus.view(-1).tolist(),
            commit_lens=plan.commit_lens.tolist(),
        ))
        return plan

    def plain_step(self, batch, draft_input, *args):
        seq_lens, roots = batch.seq_lens.tolist(), draft_input.bonus_tokens.view(-1).tolist()
        res = orig_plain(self, batch, draft_input, *args)
        write(dict(seq_lens=seq_lens, parents=[[-1]] * len(roots), tokens=[[r] for r in roots], exit_node=[0] * len(roots),
                   bonus=res.next_token_ids.view(-1).tolist(), commit_lens=res.accept_lens.tolist()))
        return res

    mod.commit_outputs = commit_outputs
    mod.TEVWorker._plain_step = plain_step


def install() -> None:
    """Wrap the worker's ``commit_outputs`` and plain step when ``SGLANG_TEV_TP_TRACE`` names a folder."""
    if not tev_env.get(ENV):
        return
    import sys

    from . import harness

    sys.meta_path.insert(0, harness.PostImport({"sglang_tev.srt.worker": _wrap_worker}))


def read(folder: str) -> dict:
    """{rank: [record, ...]} of the ``rank<R>.jsonl`` files in ``folder``."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("rank") and name.endswith(".jsonl"):
            with open(os.path.join(folder, name)) as f:
                out[int(name[4:-6])] = [json.loads(x) for x in f if x.strip()]
    return out
