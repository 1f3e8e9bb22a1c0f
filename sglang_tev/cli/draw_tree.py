"""``sglang-tev draw-tree``: where one round's draft tree loses target mass, as a picture (the
paper's Fig. 1 for a user's own pair), and per-depth exit mass over a prompt set, drafters side by
side (:mod:`sglang_tev.train.tree_exits`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from pathlib import Path

from ..paths import creatable_dir_problem
from .args import PROG, UsageError, _at_least, _int, _strip_name
from .common import _prompts_arg, _torch_device, default_model_paths
from .eval_drafter import TREE_MODE_CHOICES, _draft_with_modes

DRAW_EXAMPLES = """\
examples:
  sglang-tev draw-tree --prompt 'def read_lines(path):' --temperature 1            # the shipped pair -> tree_exit.svg
  sglang-tev draw-tree --prompts prompts.jsonl --draft D2 --draft D1 --target DIR \\
      --budget 16 --output tree.html --bars exit_mass_by_depth.svg --json numbers.json
  sglang-tev draw-tree --prompts humaneval --limit 64 --draft DFLASH2@lattice,marginal --target DIR \\
      --output tree.png --bars bars.png                     # one DFlash2 drafter, lattice vs marginal trees
"""

MAX_DRAW_BUDGET = 128
"""A tree of more nodes does not fit a readable picture (``eval-drafter`` measures any budget)."""
FIGURE_SUFFIXES = (".svg", ".png", ".html")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """The ``draw-tree`` subcommand's parser (its part of :func:`sglang_tev.cli.build_parser`)."""
    d = subparsers.add_parser(
        "draw-tree", help="draw one round's draft tree with its exit law (where the tree loses target mass)",
        description="For a prompt, draw the transformers runtime's first-round draft tree (root: the prompt's last "
        "token) of each drafter: every node's token, reach P(v), residual rho(v) and exit mass w(v) = P(v)*rho(v) "
        "under the target's law (paper Eq. 2, 4), the most likely exit node argmax w, and the target's preferred "
        "token where it leaves the tree there (argmax of the residual). Over a prompt set (--prompts), also the exit "
        "mass by depth and by node kind, mean over the prompts, one bar per drafter (--bars).",
        epilog=DRAW_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = d.add_argument_group("model")
    g.add_argument("--target", help="target model directory (HF, with tokenizer); default: the shipped tiny-code pair")
    g.add_argument("--draft", action="append", metavar="DIR",
                   help="DFlash / DFlash2 drafter directory (repeatable: one tree panel and one bar per drafter); "
                   "DIR@MODES draws this drafter in MODES (e.g. DIR@lattice,marginal) instead of --draft-mode; "
                   "default without --target: the shipped drafter")
    g.add_argument("--draft-mode", choices=TREE_MODE_CHOICES, default="auto",
                   help="how a drafter's block becomes a tree: auto (lattice for a DFlash2 drafter with a "
                   "selector, else marginal), marginal (DDTree over the draft marginals), lattice (DDTree over the "
                   "DFlash2 selector's lattice), chain (the greedy chain); default auto")
    g.add_argument("--device", help="torch device (default: cuda when available, else cpu); float32 weights")
    g.add_argument("--no-chat-template", action="store_true",
                   help="do not apply the tokenizer's chat template (default: applied when the tokenizer has one)")
    d.add_argument("--prompt", metavar="TEXT", help="the prompt (its last token is the round's root)")
    d.add_argument("--prompts", metavar="FILE",
                   help="'humaneval' or a .jsonl file (one 'prompt' or 'messages' per line): the prompt set of --bars")
    d.add_argument("--limit", type=_int, help="use the first N prompts of --prompts")
    d.add_argument("--tree-prompt", type=_int, default=0, metavar="I",
                   help="which prompt of --prompts has its tree drawn (0-based; default 0)")
    d.add_argument("--budget", type=_int, default=16,
                   help=f"DDTree budget B, non-root nodes, in [0, {MAX_DRAW_BUDGET}] (default 16)")
    d.add_argument("--temperature", type=float, default=0.0,
                   help="temperature of the target law (default 0: the greedy law, one-hot at the argmax)")
    d.add_argument("--output", default="tree_exit.svg", metavar="PATH",
                   help="the tree picture: .svg, .png or .html (the SVG and a table of every node's numbers); "
                   "default tree_exit.svg; an existing file is replaced")
    d.add_argument("--bars", metavar="PATH", help="also the per-depth exit-mass bars over the prompts (.svg, .png, .html)")
    d.add_argument("--json", metavar="PATH", help="also every round's numbers (.json)")
    d.set_defaults(run=run)
    return d


def _check_file_arg(arg: str, value: str, suffixes: tuple[str, ...]) -> Path:
    """An output file argument: a known suffix, not a directory, in a folder that can be created
    and written. Raises ``UsageError(arg)``; creates nothing."""
    path = Path(value)
    if path.is_dir():
        raise UsageError(arg, f"{value} is a directory; give a file name")
    if path.suffix.lower() not in suffixes:
        raise UsageError(arg, f"the file name must end in {', '.join(suffixes)}, got {value!r}")
    problem = creatable_dir_problem(path.parent if str(path.parent) else Path("."))
    if problem is not None:
        raise UsageError(arg, problem)
    return path


def _checked(args) -> dict:
    """Every check that needs no model; returns the settings. Raises :class:`UsageError`."""
    if args.prompt is None and args.prompts is None:
        raise UsageError("--prompt", "give --prompt TEXT or --prompts FILE")
    if args.prompt is not None and args.prompts is not None:
        raise UsageError("--prompts", "give --prompt TEXT or --prompts FILE, not both")
    if args.prompt is not None and not args.prompt.strip():
        raise UsageError("--prompt", "the prompt is empty")
    if args.prompt is not None and args.limit is not None:
        raise UsageError("--limit", "--limit goes with --prompts")
    if args.limit is not None:
        _at_least("--limit", args.limit, 1)
    _at_least("--tree-prompt", args.tree_prompt, 0)
    if not 0 <= args.budget <= MAX_DRAW_BUDGET:
        raise UsageError("--budget", f"must be in [0, {MAX_DRAW_BUDGET}] (a larger tree does not fit a picture; "
                                     f"eval-drafter measures any budget), got {args.budget}")
    if not (args.temperature >= 0) or math.isinf(args.temperature):
        raise UsageError("--temperature", f"must be a finite number >= 0, got {args.temperature}")
    outputs = {"--output": _check_file_arg("--output", args.output, FIGURE_SUFFIXES)}
    if args.bars is not None:
        outputs["--bars"] = _check_file_arg("--bars", args.bars, FIGURE_SUFFIXES)
    if args.json is not None:
        outputs["--json"] = _check_file_arg("--json", args.json, (".json",))
    seen = {}
    for arg, p in outputs.items():
        key = os.path.abspath(p)
        if key in seen:
            raise UsageError(arg, f"{p} is also {seen[key]}'s file")
        seen[key] = arg
    if args.target is not None:
        target, drafts = args.target, list(args.draft or [])
        if not drafts:
            raise UsageError("--draft", "give at least one --draft with --target")
    else:
        try:
            target, shipped = default_model_paths()
        except FileNotFoundError as e:
            raise UsageError("--target", str(e)) from None
        drafts = list(args.draft or [shipped])
    drafts, modes = zip(*(_draft_with_modes(str(d)) for d in drafts))
    for arg, path in [("--target", target)] + [("--draft", d) for d in drafts]:
        if not os.path.isdir(path):
            raise UsageError(arg, f"no model directory at {os.fspath(path)!r}")
    if args.prompt is not None:
        from ..hf.datasets import Prompt

        prompts = [Prompt(id="prompt", text=args.prompt)]
    else:
        prompts = _prompts_arg("--prompts", args.prompts, args.limit)
    if args.tree_prompt >= len(prompts):
        raise UsageError("--tree-prompt", f"must be < the {len(prompts)} prompt(s) of --prompts, got {args.tree_prompt}")
    return {"target": target, "drafts": list(drafts), "modes": [[args.draft_mode] if m is None else m for m in modes],
            "mode_arg": ["--draft-mode" if m is None else "--draft" for m in modes], "prompts": prompts,
            "outputs": outputs}


def run(args, argv: list[str]) -> int:
    """``sglang-tev draw-tree``: :func:`sglang_tev.train.tree_exits.round_trees`, then the pictures."""
    cfg = _checked(args)
    device = _torch_device(args.device)
    import torch

    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass
    from ..hf.datasets import encode_prompt
    from ..train import tree_exits as te
    from ..train.drafter_eval import _tree_modes_of, load_models

    prompt_arg = "--prompt" if args.prompt is not None else "--prompts"
    try:
        target, tokenizer, drafters, names = load_models(cfg["target"], cfg["drafts"], device)
    except (FileNotFoundError, ValueError) as e:
        msg = str(e)
        raise UsageError("--target" if msg.startswith("target") else "--draft", _strip_name(msg)) from None
    for d, m, arg, path in zip(drafters, cfg["modes"], cfg["mode_arg"], cfg["drafts"]):
        try:
            _tree_modes_of(d, m)
        except ValueError as e:
            raise UsageError(arg, f"{path}: {_strip_name(str(e))}") from None
    prompts = cfg["prompts"]
    ids = [encode_prompt(p, tokenizer, not args.no_chat_template) for p in prompts]
    try:
        rows = te.round_trees(target, tokenizer, drafters, ids, budget=args.budget, temperature=args.temperature,
                              tree_modes=cfg["modes"], names=names, prompt_names=[p.id for p in prompts])
    except ValueError as e:
        raise UsageError(prompt_arg, _strip_name(str(e)).removeprefix("prompt_ids: ")) from None
    k = args.tree_prompt
    shown = [r[k] for r in rows]
    tail = tokenizer.decode(ids[k][-24:])
    title = f"prompt {prompts[k].id}: …{te.token_label(tail, 60)}" if prompts[k].id != "prompt" else \
        f"prompt: …{te.token_label(tail, 60)}"
    outs = cfg["outputs"]
    files = {outs["--output"]: te.render(te.draw_round_trees(shown, title), outs["--output"].suffix.lower(), shown)}
    if "--bars" in outs:
        where = "/".join(Path(os.path.abspath(cfg["target"])).parts[-2:])
        files[outs["--bars"]] = te.render(te.draw_exit_bars(rows, f"target {where}: first-round draft trees"),
                                          outs["--bars"].suffix.lower())
    if "--json" in outs:
        rep = {"command": shlex.join([PROG, *argv]), "target": os.fspath(cfg["target"]),
               "draft_paths": [os.fspath(p) for p in cfg["drafts"]], "rows": [r[0].name for r in rows],
               "budget": args.budget, "temperature": args.temperature, "tree_prompt": k,
               "prompts": [p.id for p in prompts],
               "mean": {r[0].name: te.mean_exit_mass(r) for r in rows},
               "rounds": {r[0].name: [x.to_dict() for x in r] for r in rows}}
        files[outs["--json"]] = (json.dumps(rep, indent=1, ensure_ascii=False) + "\n").encode()
    for p in files:
        p.parent.mkdir(parents=True, exist_ok=True)
    te.write_outputs(files)
    for r, rt in zip(rows, shown):
        e = rt.nodes[rt.exit_node]
        line = (f"{rt.name}: 1 + C_p {rt.block_len:.4f}, {len(rt.nodes) - 1} nodes, most likely exit node "
                f"{rt.exit_node} (depth {e.depth}, w {e.w:.4f}), target's token there {rt.exit_text!r} "
                f"(p_res {rt.exit_prob:.4f}), root w {rt.nodes[0].w:.4f}")
        if len(r) > 1:
            m = te.mean_exit_mass(r)
            line += f"; over {m['prompts']} prompts: mean 1 + C_p {m['block_len']:.4f}"
        print(line)
    print(f"[{PROG}] wrote {', '.join(str(p) for p in files)}", file=sys.stderr)
    return 0
