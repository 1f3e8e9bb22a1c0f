"""``python -m sglang_tev.train --config run.yaml [key=value ...]`` (also under ``torchrun``).

Exit status: 0 done (or stopped at ``stop_at_step``), 2 config / input error (message on stderr
naming the key, or an unknown ``SGLANG_TEV_*`` variable: ``docs/env.md``), 130 interrupted (the
last checkpoint is intact; rerun to resume).
"""

from __future__ import annotations

import argparse
import os
import sys

PROG = "python -m sglang_tev.train"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=PROG, description="Train a DFlash drafter against a frozen HF target (docs/training.md).",
        epilog="Overrides are dotted keys with YAML values, e.g. lr=3e-4 loss_decay_gamma=7 "
               "draft.num_hidden_layers=2 draft.target_layer_ids=[1,3]. Keys: docs/training.md.")
    p.add_argument("--config", metavar="YAML", help="run config file (optional when every "
                   "required key is given as an override)")
    p.add_argument("--print-config", action="store_true",
                   help="print the validated config as YAML and exit")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args(argv)
    if args.config is None and not args.overrides:
        p.error("--config is required (or give every required key as key=value)")

    from ..env import EnvError, check_environment
    from .config import ConfigError, config_to_dict, load_config

    try:
        check_environment()  # an unknown SGLANG_TEV_* name (a typo) is refused, not ignored
    except EnvError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        import yaml
        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
        if cfg.warmup_ratio is None and cfg.warmup_steps is None:  # null means the default, say which
            print(f"# warmup: warmup_ratio and warmup_steps unset -> {cfg.warmup} steps (ratio 0.04 of max_steps)")
        return 0

    from .trainer import train

    try:
        res = train(cfg)
    except (ConfigError, FileNotFoundError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        if str(e).split(":", 1)[0] in ("target", "data", "eval_data", "draft_init", "resume",
                                       "rollout.prompts", "rollout.cache"):
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 2
        raise
    except KeyboardInterrupt:
        print(f"[{PROG}] interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun rank 0 alone reports
        return 0
    if res.complete:
        print(f"[{PROG}] done: {res.step} steps; drafter exported to {res.final_dir}", file=sys.stderr)
    else:
        print(f"[{PROG}] stopped at step {res.step}; rerun to resume", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
