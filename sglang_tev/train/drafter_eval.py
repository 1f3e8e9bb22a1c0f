"""Drafter comparison at fixed contexts: the expected block length ``1 + C_p`` of the drafter's own
DDTree at every position of the target's own continuations (``sglang-tev eval-drafter``;
docs/exittrain.md, "Measuring a drafter").

For a context ``x_{<=a}`` (root ``x_a``) the drafter's block gives the per-depth marginals, the
inference builder (:func:`sglang_tev.draft.ddtree.build_ddtree`, budget B) the tree, and the frozen
target's law at temperature T on every node ``x_{<=a} ‖ π(v)`` the canonical exit law
(:func:`sglang_tev.tree.exit_law`, paper §3). ``1 + C_p`` is then the EXACT expected length of the
block a saturated exact verifier (TEV, predraw, sequential) emits in a round rooted there
(paper Theorem 1) — no sampling of the verifier. Averaged over every position of FIXED target
continuations and paired across drafters (same contexts), its differences have a standard error
far below that of realized τ.

Computation per continuation (``x = prompt ‖ response``, roots ``a = P-1 .. L-2``: one round per
response token): one target forward over ``x`` (features for every drafter, KV kept), the
drafter's training-time block forward (:func:`sglang_tev.train.losses.block_logits`, identical
to its inference forward: context strictly before the anchor) in chunks of anchors, then the tree
metric of :mod:`.metrics` (:func:`~.metrics.tree_breakdowns`, also the trainer's evaluation): the
trees, their target rows scored over the sequence's KV, all temperatures' laws from one tree pass.
Trees are built without stop-token leaves (as ``--ignore-eos`` decoding).

Tree modes (:data:`~.exit.TREE_MODES`; ``auto`` = ``lattice`` for a DFlash2 drafter with a
candidate selector, else ``marginal``): ``marginal`` (DDTree over the per-depth draft marginals;
DFlash2 logits after its logit transform, :func:`~.metrics.draft_blocks`), ``lattice`` (DDTree over
the selector's lattice), ``chain`` (the selector's greedy walk, or the per-depth argmax: K-1 nodes
whatever B). Each (drafter, mode) is one row of the report, ``<drafter>[<mode>]``.

Statistics: the metric of a drafter is the pooled mean over positions, ``M = Σ_i S_i / Σ_i n_i``
(prompt i: ``n_i`` positions, sum ``S_i``). Its standard error, and that of a paired difference
``D = Σ_i (S_i^j - S_i^0) / Σ_i n_i``, are cluster-robust over prompts (positions of one prompt are
correlated): ``SE = sqrt(m/(m-1) Σ_i (d_i - D n_i)^2) / Σ_i n_i`` for m prompts.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from ..atomic import atomic_write
from ..machine import machine_info
from ..spec import MAX_BUDGET
from .exit import kv_reuse_forward
# the tree metric (one pipeline with the trainer's evaluation); re-exported: its public home was here
from .metrics import BREAKDOWN_KEYS, TreeBreakdown, exit_breakdown, laws_by_temperature, tree_breakdowns

__all__ = ["TreeBreakdown", "exit_breakdown", "sequence_block_stats", "laws_by_temperature",
           "cluster_se", "paired_difference", "load_models", "evaluate_drafters", "format_table", "plot_exit_mass"]


def _tree_modes_of(draft, modes) -> list[str]:
    """A drafter's requested modes (a str or a list of ``auto`` / :data:`~.exit.TREE_MODES`)
    resolved (:func:`~.metrics.resolve_tree_mode`) and deduplicated, in order. ValueError naming
    ``tree_modes`` for an unknown mode or ``lattice`` on a drafter without a selector."""
    from .metrics import resolve_tree_mode

    out = []
    for m in ([modes] if isinstance(modes, str) else list(modes)):
        try:
            r = resolve_tree_mode(draft, m)
        except ValueError as e:
            raise ValueError(f"tree_modes: {str(e).partition(': ')[2] or e}") from None
        if r not in out:
            out.append(r)
    if not out:
        raise ValueError("tree_modes: no tree mode given")
    return out


def _cat_lattices(parts: list, b: int):
    """Concatenate per-chunk selector lattices over ``b·n_chunk`` blocks (row ``bi·n_chunk + j``)
    into one over ``b·n`` blocks (row ``bi·n + j``)."""
    from ..draft.dflash2 import SelectorLattice

    def cat(name):
        ts = [getattr(p, name) for p in parts]
        return torch.cat([t.reshape(b, -1, *t.shape[1:]) for t in ts], 1).flatten(0, 1)
    return SelectorLattice(**{f: cat(f) for f in ("candidate_ids", "unary_logq", "scores", "transition_logq")})


@torch.no_grad()
def sequence_block_stats(target, drafters: Sequence, ids: torch.Tensor, anchors: torch.Tensor,
                         keep: torch.Tensor, budgets: Sequence[int], temperatures: Sequence[float],
                         anchors_per_forward: int | None = None, draft_chunk: int = 64,
                         tree_modes: Sequence | None = None,
                         ) -> list[dict[tuple[int, float], TreeBreakdown]]:
    """Exit-law breakdown of every drafter's tree at every anchor of a batch of sequences.

    Args:
        target: the frozen HF causal LM (``get_decoder``, ``get_input_embeddings``,
            ``get_output_embeddings``); its attention must take a 4-D mask (sdpa / eager).
        drafters: :class:`~sglang_tev.draft.dflash.DFlashDraftModel` s fitting the target
            (DFlash v1 or DFlash2; DFlash2 logits go through its logit transform).
        ids: int64 [b, S] (rows right-padded; padding is never a root nor in a root's context).
        anchors: int64 [b, n], root positions; keep: bool [b, n] (False: skipped, no tree).
            A kept anchor needs ``anchors + K - 1 < max_positions`` of the target and the drafter.
        budgets: DDTree budgets B (non-root nodes); temperatures: target-law temperatures.
        anchors_per_forward: anchors per tree forward (None: the trainer's default).
        draft_chunk: anchors per drafter block forward (bounds the block mask).
        tree_modes: per drafter, a mode or a list of modes, each ``auto`` or one of
            :data:`~.exit.TREE_MODES` (:func:`~.metrics.resolve_tree_mode`; ``auto``: ``lattice``
            for a drafter with a selector, else ``marginal``); None = ``auto`` for every drafter.
            ``chain`` (K-1 nodes) ignores B: its breakdown is the same object under every B.
    Returns:
        one ``{(B, T): TreeBreakdown}`` per (drafter, resolved mode), drafter-major, modes in the
        order given (deduplicated; with ``tree_modes`` None: one per drafter); [b*n] rows (row
        ``bi*n + j`` = anchor ``anchors[bi, j]``; rows of dropped anchors are present and
        meaningless: mask with ``keep``).
    Raises:
        ValueError naming ``tree_modes`` (wrong length, unknown mode, ``lattice`` without a selector).
    """
    from transformers import DynamicCache

    from ..draft.dflash import extract_context_features
    from ..compat import cache_kwargs
    from .metrics import draft_blocks

    if tree_modes is None:
        tree_modes = ["auto"] * len(drafters)
    if isinstance(tree_modes, str) or len(tree_modes) != len(drafters):
        raise ValueError(f"tree_modes: expected one entry per drafter ({len(drafters)}), got {tree_modes!r}")
    modes = [_tree_modes_of(d, m) for d, m in zip(drafters, tree_modes)]
    decoder, embed, head = target.get_decoder(), target.get_input_embeddings(), target.get_output_embeddings()
    mask_dtype = next(target.parameters()).dtype
    cache = DynamicCache()
    out = decoder(input_ids=ids, output_hidden_states=True, use_cache=True, **cache_kwargs(decoder, cache))
    last = out.last_hidden_state
    b, n = anchors.shape
    roots = ids.gather(1, anchors).reshape(-1)
    res = []
    for draft, dmodes in zip(drafters, modes):
        K = draft.config.block_size
        has_selector = getattr(draft.config, "selector_rank", None) is not None
        block_mode = "lattice" if has_selector and any(m in ("lattice", "chain") for m in dmodes) else "marginal"
        feats = extract_context_features(out.hidden_states, draft.config.target_layer_ids)
        chunks, lats = [], []
        for j0 in range(0, n, draft_chunk):
            sl = slice(j0, min(n, j0 + draft_chunk))
            lg, _, lat = draft_blocks(draft, embed, head, feats, ids, anchors[:, sl], keep[:, sl], K, block_mode)
            chunks.append(lg)
            lats.append(lat)
        logits = torch.cat(chunks, 1).reshape(b * n, K - 1, -1)          # [b*n, H, V]
        lattice = _cat_lattices(lats, b) if block_mode == "lattice" else None
        for mode in dmodes:
            per = {}
            for B in (budgets[:1] if mode == "chain" else budgets):
                brs = tree_breakdowns(logits, B, roots, keep.reshape(-1), kv_reuse_forward(decoder, cache), head,
                                      last, anchors, temperatures, anchors_per_forward, mask_dtype,
                                      lattice=lattice if mode != "marginal" else None, mode=mode)
                for B2 in (budgets if mode == "chain" else [B]):
                    per.update({(B2, t): br for t, br in zip(temperatures, brs)})
            res.append(per)
    return res


# ----------------------------------------------------------------------------------------------
# statistics over prompts
# ----------------------------------------------------------------------------------------------

def cluster_se(sums: Sequence[float], counts: Sequence[float]) -> tuple[float, float]:
    """``(mean, SE)`` of the pooled mean ``Σ s_i / Σ n_i`` with the SE cluster-robust over
    clusters i (prompts): ``sqrt(m/(m-1) Σ (s_i - mean·n_i)^2) / Σ n_i``; SE is nan for one cluster.

    Raises ValueError naming ``counts`` when the lengths differ or no count is positive.
    """
    if len(sums) != len(counts):
        raise ValueError(f"counts: {len(counts)} clusters for {len(sums)} sums")
    N = float(sum(counts))
    if not N > 0:
        raise ValueError("counts: no positive count")
    mean = float(sum(sums)) / N
    m = len(sums)
    if m < 2:
        return mean, math.nan
    ss = sum((s - mean * c) ** 2 for s, c in zip(sums, counts))
    return mean, math.sqrt(m / (m - 1) * ss) / N


def paired_difference(sums_a: Sequence[float], sums_b: Sequence[float], counts: Sequence[float]) -> tuple[float, float]:
    """``(D, SE)`` of ``D = Σ (a_i - b_i) / Σ n_i`` on the SAME positions (cluster-robust over
    prompts, :func:`cluster_se` on the per-prompt differences). A drafter against itself gives
    exactly ``(0.0, 0.0)``."""
    if len(sums_a) != len(sums_b):
        raise ValueError(f"sums_b: {len(sums_b)} prompts, sums_a has {len(sums_a)}")
    return cluster_se([a - b for a, b in zip(sums_a, sums_b)], counts)


# ----------------------------------------------------------------------------------------------
# the command
# ----------------------------------------------------------------------------------------------

def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def prompt_cache_file(cache_dir: Path, prompt_ids: list[list[int]]) -> Path:
    """Write (once) the tokenized prompts as a rollout prompt file ``prompts-<sha>.jsonl``."""
    text = "".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompt_ids)
    path = cache_dir / f"prompts-{_sha(text.encode())[:16]}.jsonl"
    if not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(path, text, tmp=path.with_name(path.name + f".tmp{os.getpid()}"))
    return path


def continuations(target, tokenizer, target_path, prompt_ids: list[list[int]], temperature: float,
                  max_new_tokens: int, seed: int, cache_dir: Path, batch_size: int = 16,
                  device: torch.device | None = None, progress: bool = True) -> tuple[Path, list[list[int]]]:
    """The target's own continuations of ``prompt_ids`` at ``temperature`` (plain sampling,
    :func:`sglang_tev.train.rollout.ensure_rollouts`), generated once and cached in ``cache_dir``
    under a file named by the hash of everything they depend on (target path, prompts, temperature,
    max_new_tokens, seed, batch size); a partial file is completed. Returns (path, responses)."""
    from .config import RolloutConfig
    from .rollout import ensure_rollouts, rollout_settings

    pfile = prompt_cache_file(cache_dir, prompt_ids)
    cfg = RolloutConfig(prompts=str(pfile), max_new_tokens=max_new_tokens, temperature=float(temperature),
                        batch_size=batch_size, chat_template=False, seed=seed)
    key = _sha(json.dumps(rollout_settings(cfg, target_path), sort_keys=True).encode())[:16]
    cfg = RolloutConfig(**{**cfg.__dict__, "cache": str(cache_dir / f"continuations-T{temperature:g}-{key}.jsonl")})
    path = ensure_rollouts(target, tokenizer, cfg, target_path, cache_dir, device or torch.device("cpu"),
                           progress=progress)
    rows = [json.loads(ln) for ln in path.read_text().splitlines()]
    if [r["prompt_ids"] for r in rows] != prompt_ids:
        raise RuntimeError(f"{path}: the cached continuations do not belong to these prompts")
    return path, [r["response_ids"] for r in rows]


def _drafter_name(path, names: list[str]) -> str:
    base = os.path.basename(os.path.normpath(path)) or str(path)
    name, i = base, 2
    while name in names:
        name, i = f"{base}#{i}", i + 1
    return name


def load_models(target_path, draft_paths: Sequence, device: torch.device | None = None):
    """The target (float32, eval, with its tokenizer) and the drafters of a fixed-context comparison.

    Returns ``(target, tokenizer, drafters, names)``: ``names`` the drafters' directory names,
    made unique (``draft``, ``draft#2``). Raises ValueError naming ``target`` (no tokenizer, a
    target that cannot score trees over a reused KV cache, a drafter directory given as target)
    or ``draft`` (a drafter that does not fit the target); FileNotFoundError for a missing directory.
    """
    from ..draft.dflash import DFlashDraftModel
    from .exit import check_tree_support
    from .target import load_target, text_config

    device = device or torch.device("cpu")
    target, tokenizer = load_target(target_path, device, torch.float32)
    if tokenizer is None:
        raise ValueError(f"target: {os.fspath(target_path)!r} has no tokenizer; text prompts need one")
    check_tree_support(target)
    tcfg = text_config(target)
    drafters, names = [], []
    for p in draft_paths:
        try:
            d = DFlashDraftModel.from_pretrained(p, dtype=torch.float32).to(device).eval()
            d.validate_against_target(tcfg)
        except ValueError as e:
            raise ValueError(f"draft: {os.fspath(p)}: {e}") from None
        drafters.append(d)
        names.append(_drafter_name(p, names))
    return target, tokenizer, drafters, names


def evaluate_drafters(target_path, draft_paths: Sequence, prompts: Sequence, *, temperatures: Sequence[float] = (0.0, 1.0),
                      budgets: Sequence[int] = (64,), max_new_tokens: int = 128, seed: int = 0,
                      output_dir=None, cache_dir=None, chat_template: bool = True, batch_size: int = 16,
                      device: torch.device | None = None, anchors_per_forward: int | None = None,
                      progress: bool = True, command: str | None = None, tree_modes: Sequence[str] = ("auto",),
                      draft_tree_modes: Sequence | None = None) -> dict:
    """Compare drafters on the target's own continuations (the Python API of ``eval-drafter``).

    Args:
        target_path: HF target directory (with tokenizer); draft_paths: z-lab drafter directories
            (the first is the baseline of the paired differences; the same path twice is allowed).
        prompts: :class:`sglang_tev.hf.datasets.Prompt` s (``load_prompts``).
        temperatures: target temperatures (continuations AND the law at each); budgets: DDTree B.
        max_new_tokens: continuation length at most (EOS ends one early).
        seed: the continuations' sampling seed (batch i: ``seed * 1_000_003 + i``).
        tree_modes: how each drafter's block becomes a tree, ``auto`` or :data:`~.exit.TREE_MODES`
            (``auto``: ``lattice`` for a DFlash2 drafter with a selector, else ``marginal``); each
            (drafter, resolved mode) is one row of the report, named ``<drafter>[<mode>]``.
            ``lattice`` on a drafter without a selector is skipped for it with a note (``notes``)
            when it leaves the drafter another mode, else a ValueError naming ``tree_modes``.
            ``chain`` (the greedy chain, K-1 nodes) does not depend on B: the same value per B.
        draft_tree_modes: None, or per drafter None (use ``tree_modes``) or its own list of modes
            (the CLI's ``--draft DIR@MODES``; errors then name ``draft``).
        output_dir: where ``results.json``, ``table.txt`` and ``exit_mass_by_depth.png`` go
            (None: nothing written); cache_dir: the continuations' cache (None:
            ``output_dir/continuations``).
    Returns:
        the results dict written to ``results.json`` (see docs/cli.md, ``eval-drafter``).
    Raises:
        ValueError naming ``prompts``, ``budgets``, ``temperatures``, ``max_new_tokens``, ``target``,
        ``draft`` or ``tree_modes``; FileNotFoundError for a missing model directory.
    """
    from tqdm import tqdm

    from ..hf.datasets import applies_chat_template, encode_prompt
    from .exit import TREE_MODES
    from .target import text_config

    if not draft_paths:
        raise ValueError("draft: give at least one drafter")
    if not prompts:
        raise ValueError("prompts: no prompts")
    if not budgets or any(isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= MAX_BUDGET for b in budgets):
        raise ValueError(f"budgets must be ints in [0, {MAX_BUDGET}], got {list(budgets)}")
    if not temperatures or any(not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0) for t in temperatures):
        raise ValueError(f"temperatures must be finite numbers >= 0, got {list(temperatures)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    known = ("auto", *TREE_MODES)
    if isinstance(tree_modes, str) or not tree_modes or any(m not in known for m in tree_modes):
        raise ValueError(f"tree_modes: give a non-empty list of {list(known)}, got {tree_modes!r}")
    if draft_tree_modes is None:
        draft_tree_modes = [None] * len(draft_paths)
    if len(draft_tree_modes) != len(draft_paths):
        raise ValueError(f"draft: {len(draft_tree_modes)} tree-mode overrides for {len(draft_paths)} drafters")
    for dm in draft_tree_modes:
        if dm is not None and (isinstance(dm, str) or not dm or any(m not in known for m in dm)):
            raise ValueError(f"draft: tree modes must be a non-empty list of {list(known)}, got {dm!r}")
    for p in draft_paths:
        if not os.path.isdir(p):
            raise FileNotFoundError(f"draft: no drafter directory at {os.fspath(p)!r}")
    if output_dir is None and cache_dir is None:
        raise ValueError("cache_dir: give output_dir or cache_dir (the continuations are cached there)")
    device = device or torch.device("cpu")
    target, tokenizer, drafters, names = load_models(target_path, draft_paths, device)
    tcfg = text_config(target)
    # rows: (drafter index, resolved tree mode)
    rows, notes = [], []
    for k, (d, p) in enumerate(zip(drafters, draft_paths)):
        asked, arg = (tree_modes, "tree_modes") if draft_tree_modes[k] is None else (draft_tree_modes[k], "draft")
        has_selector = getattr(d.config, "selector_rank", None) is not None
        kept = [m for m in asked if has_selector or m != "lattice"]
        if not kept:
            raise ValueError(f"{arg}: {os.fspath(p)}: 'lattice' needs a DFlash2 drafter with a candidate selector; "
                             "this one has none (measure it as marginal or chain)")
        if len(kept) < len(asked):
            notes.append(f"{names[k]}: no candidate selector, tree mode 'lattice' skipped")
            print(f"eval-drafter: note: {notes[-1]}", file=sys.stderr)
        rows.extend((k, m) for m in _tree_modes_of(d, kept))
    row_names = [f"{names[k]}[{m}]" for k, m in rows]
    row_modes = {k: [m for k2, m in rows if k2 == k] for k in range(len(drafters))}
    K = max(d.config.block_size for d in drafters)
    max_pos = int(getattr(tcfg, "max_position_embeddings", 1 << 30))
    prompt_ids = []
    for p in prompts:
        ids = encode_prompt(p, tokenizer, chat_template)
        if not ids:
            raise ValueError(f"prompts: {p.id}: the prompt has no tokens")
        if len(ids) + max_new_tokens + K > max_pos:
            raise ValueError(f"prompts: {p.id}: {len(ids)} prompt tokens + max_new_tokens {max_new_tokens} + block "
                             f"{K} exceed the target's {max_pos} positions; lower max_new_tokens or shorten it")
        prompt_ids.append(ids)
    out = Path(output_dir) if output_dir is not None else None
    cache = Path(cache_dir) if cache_dir is not None else out / "continuations"
    temps = [float(t) for t in temperatures]
    t0 = time.perf_counter()
    conts = {}
    for t in temps:
        path, resp = continuations(target, tokenizer, target_path, prompt_ids, t, max_new_tokens, seed, cache,
                                   batch_size, device, progress)
        conts[t] = (path, resp)
    t_gen = time.perf_counter() - t0
    # per (row, T, B): per-prompt sums of every breakdown field; counts per (T, prompt)
    sums = {(r, t, b): {f: [] for f in (*BREAKDOWN_KEYS, "w_depth")} for r in range(len(rows))
            for t in temps for b in budgets}
    counts = {t: [] for t in temps}
    bar = tqdm(total=len(temps) * len(prompts), desc="eval-drafter", unit="prompt", file=sys.stderr,
               dynamic_ncols=True, disable=not progress, mininterval=0.5 if sys.stderr.isatty() else 30)
    t1 = time.perf_counter()
    try:
        for t in temps:
            for ids_p, resp in zip(prompt_ids, conts[t][1]):
                x = torch.tensor([ids_p + resp], dtype=torch.int64, device=device)
                P, L = len(ids_p), x.shape[1]
                anchors = torch.arange(P - 1, L - 1, device=device)[None]
                keep = torch.ones_like(anchors, dtype=torch.bool)
                counts[t].append(int(keep.sum()))
                if anchors.shape[1] == 0:  # an empty response: no position to score
                    for key in sums:
                        if key[1] == t:
                            for f in BREAKDOWN_KEYS:
                                sums[key][f].append(0.0)
                            sums[key]["w_depth"].append([0.0] * drafters[rows[key[0]][0]].config.block_size)
                    bar.update(1)
                    continue
                stats = sequence_block_stats(target, drafters, x, anchors, keep, list(budgets), [t],
                                             anchors_per_forward,
                                             tree_modes=[row_modes[k] for k in range(len(drafters))])
                for k, per in enumerate(stats):
                    for b in budgets:
                        br = per[(b, t)]
                        s = sums[(k, t, b)]
                        for f in BREAKDOWN_KEYS:
                            s[f].append(float(getattr(br, f).sum()))
                        s["w_depth"].append(br.w_depth.sum(0).tolist())
                bar.update(1)
    finally:
        bar.close()
    t_score = time.perf_counter() - t1
    results = []
    for t in temps:
        n = counts[t]
        for b in budgets:
            base = sums[(0, t, b)]
            for r, name in enumerate(row_names):
                k, mode = rows[r]
                s = sums[(r, t, b)]
                rec = {"drafter": name, "drafter_name": names[k], "tree_mode": mode,
                       "draft_path": os.fspath(draft_paths[k]), "temperature": t, "budget": b,
                       "positions": sum(n), "prompts": len(n)}
                for f in BREAKDOWN_KEYS:
                    rec[f], rec[f + "_se"] = cluster_se(s[f], n)
                depth = list(zip(*s["w_depth"]))
                rec["w_depth"] = [sum(col) / sum(n) for col in depth]
                if r > 0:
                    d, se = paired_difference(s["block_len"], base["block_len"], n)
                    ref = cluster_se(base["block_len"], n)[0]
                    rec["diff_vs_first"] = {"block_len": d, "block_len_se": se, "pct": 100 * d / ref,
                                            "pct_se": 100 * se / ref, "baseline": row_names[0]}
                rec["per_prompt"] = {"positions": n, "block_len_sum": s["block_len"], "w_root_sum": s["w_root"]}
                results.append(rec)
    rep = {"command": command, "target": os.fspath(target_path), "drafters": names,
           "draft_paths": [os.fspath(p) for p in draft_paths],
           "tree_modes": list(tree_modes), "rows": row_names, "row_modes": [m for _, m in rows], "notes": notes,
           "temperatures": temps, "budgets": list(budgets), "max_new_tokens": max_new_tokens, "seed": seed,
           "prompts": [p.id for p in prompts],
           "chat_template": applies_chat_template(tokenizer, chat_template),
           "continuations": {f"{t:g}": os.fspath(conts[t][0]) for t in temps},
           "generate_s": round(t_gen, 2), "score_s": round(t_score, 2),
           "machine": {**machine_info("platform", cpus="cpu_count", python="python", torch="torch",
                                      threads="torch_threads"), "device": str(device)},
           "results": results}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(rep, indent=1) + "\n")
        (out / "table.txt").write_text(format_table(rep) + "\n")
        plot_exit_mass(rep, out / "exit_mass_by_depth.png")
    return rep


def format_table(rep: dict) -> str:
    """The plain-text table of :func:`evaluate_drafters`' results (one row per (drafter, tree mode),
    T, B; a ``chain`` row's B is irrelevant: the chain has K-1 nodes whatever B)."""
    w = max([20] + [len(r["drafter"]) for r in rep["results"]])
    hdr = f"{'T':>4} {'B':>5} {'drafter':<{w}} {'1+C_p':>8} {'± SE':>7} {'root':>6} {'inner':>6} {'cut':>6} " \
          f"{'horizon':>7} {'Δ vs first':>11} {'± SE':>7} {'Δ %':>7} {'± SE':>6}"
    lines = [hdr]
    for r in rep["results"]:
        d = r.get("diff_vs_first")
        tail = "" if d is None else f" {d['block_len']:+11.4f} {d['block_len_se']:7.4f} {d['pct']:+6.2f}% {d['pct_se']:5.2f}%"
        lines.append(f"{r['temperature']:>4g} {r['budget']:>5} {r['drafter']:<{w}} {r['block_len']:8.4f} "
                     f"{r['block_len_se']:7.4f} {r['w_root']:6.3f} {r['w_inner']:6.3f} {r['w_cut']:6.3f} "
                     f"{r['w_horizon']:7.3f}" + tail)
    return "\n".join(lines)


def plot_exit_mass(rep: dict, path) -> None:
    """Exit mass by depth (mean over positions), one panel per temperature, a line per (row, B)
    (a ``chain`` row once: it does not depend on B)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = rep["temperatures"]
    fig, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 3.6), squeeze=False)
    for ax, t in zip(axes[0], temps):
        for r in rep["results"]:
            chain = r.get("tree_mode") == "chain"
            if r["temperature"] == t and not (chain and r["budget"] != rep["budgets"][0]):
                budget = "" if chain else f" B={r['budget']}"
                ax.plot(range(len(r["w_depth"])), r["w_depth"], marker="o", ms=3,
                        label=f"{r['drafter']}{budget} (1+C_p {r['block_len']:.3f})")
        ax.set_title(f"T = {t:g}")
        ax.set_xlabel("exit depth (0 = root)")
        ax.set_ylabel("mean exit mass")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
