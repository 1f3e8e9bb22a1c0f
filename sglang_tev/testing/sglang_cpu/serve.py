"""Try SGLang's HTTP server with TEV on a CPU that lacks sgl-kernel's CPU build.

    python -m sglang_tev.testing.sglang_cpu.serve --model-path TARGET \\
        --speculative-algorithm TEV --speculative-draft-model-path DRAFT \\
        --speculative-num-draft-tokens 17 [any other sglang.launch_server flag]

runs ``python -m sglang.launch_server`` with those flags in an environment that loads this
package's CPU harness in every SGLang process (:func:`.harness.harness_env`). The harness replaces
the few sgl-kernel ops SGLang's CPU engine calls with plain-torch stand-ins: this is for trying the
server and testing against it, not for speed, and it is what the project's Engine and server tests
run. A real CPU deployment needs sgl-kernel's CPU build (a CPU with AVX-512 and AMX) and no harness:
``SGLANG_USE_CPU_ENGINE=1 python -m sglang.launch_server --device cpu --attention-backend tev_cpu ...``.

Flags the user did not pass get CPU defaults (:data:`CPU_DEFAULTS`), and the KV pool is sized to
the model instead of to free memory (SGLang's default took 15.9 GB of a 24 GB machine for a
2,048-token model): ``--max-total-tokens`` = ``--max-running-requests`` x the context length,
capped at :data:`KV_SHARE_OF_AVAILABLE` of the memory available now. The chosen sizes are printed
to stderr before SGLang starts.
"""

from __future__ import annotations

import os
import sys

CPU_DEFAULTS = {
    "--device": "cpu",
    "--attention-backend": "tev_cpu",  # sglang_tev.srt.cpu_attention: applies the tree mask in torch
    "--dtype": "bfloat16",  # the DFlash drafter's embeddings reach it in bf16 on this path
    "--max-running-requests": "8",
    "--chunked-prefill-size": "512",
    "--mem-fraction-static": "0.3",  # of free RAM; the pool itself is capped by --max-total-tokens
}
SWITCHES = ("--disable-cuda-graph",)  # SGLang has no CPU graph runner for speculative algorithms
KV_SHARE_OF_AVAILABLE = 0.25
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "auto": 2}


def _given(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``argv`` (``--flag V`` or ``--flag=V``), ``""`` for a bare switch,
    None when absent."""
    for i, a in enumerate(argv):
        if a == flag:
            return argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else ""
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def kv_pool_tokens(model_path: str, argv: list[str], available: int | None) -> tuple[int, str]:
    """``(tokens, why)``: the KV pool size for ``argv``'s model, and one line saying how it was
    chosen. Reads the model's config (context length, layers, KV heads, head size) with
    transformers; raises ``ValueError`` naming ``--max-total-tokens`` when not even one request of
    the full context fits the memory share."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path)
    cfg = getattr(cfg, "text_config", None) or cfg
    context = int(_given(argv, "--context-length") or cfg.max_position_embeddings)
    running = int(_given(argv, "--max-running-requests") or CPU_DEFAULTS["--max-running-requests"])
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    dtype = _given(argv, "--kv-cache-dtype") or _given(argv, "--dtype") or CPU_DEFAULTS["--dtype"]
    per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 2)
    want = context * running
    if available is None:
        return want, f"{running} requests x {context} tokens (available memory unknown)"
    cap = int(KV_SHARE_OF_AVAILABLE * available) // per_token
    if cap < context:
        raise ValueError(
            f"--max-total-tokens: one request of {context} tokens needs {context * per_token / 2**20:.0f} MiB of KV, "
            f"more than {KV_SHARE_OF_AVAILABLE:.0%} of the {available / 2**30:.1f} GiB available; pass "
            "--context-length or --max-total-tokens"
        )
    tokens = min(want, cap)
    return tokens, (
        f"{tokens} tokens = {tokens * per_token / 2**20:.0f} MiB "
        f"({running} requests x {context} tokens{', capped by memory' if tokens < want else ''})"
    )


def launch_argv(argv: list[str], available: int | None = None) -> tuple[list[str], list[str]]:
    """``(argv for sglang.launch_server, notes)``: the user's flags plus every CPU default they did
    not pass. Raises ``ValueError`` naming ``--model-path`` when it is missing."""
    model = _given(argv, "--model-path") or _given(argv, "--model")
    if not model:
        raise ValueError("--model-path: required (the target model's folder or hub id)")
    out, notes = list(argv), []
    for flag, value in CPU_DEFAULTS.items():
        if _given(argv, flag) is None:
            out += [flag, value]
    for flag in SWITCHES:
        if _given(argv, flag) is None:
            out.append(flag)
    if _given(argv, "--max-total-tokens") is None:
        tokens, why = kv_pool_tokens(model, argv, _available_bytes() if available is None else available)
        out += ["--max-total-tokens", str(tokens)]
        notes.append(f"KV pool: {why}; pass --max-total-tokens to change it")
    return out, notes


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    from .harness import harness_env

    try:
        args, notes = launch_argv(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        "sglang-tev CPU harness: SGLang's sgl-kernel ops run as plain-torch stand-ins "
        "(for trying and testing, not for speed)",
        file=sys.stderr,
    )
    for n in notes:
        print(n, file=sys.stderr)
    sys.stderr.flush()
    cmd = [sys.executable, "-m", "sglang.launch_server", *args]
    os.execve(sys.executable, cmd, harness_env())
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
