"""A ``sglang.Engine`` in its own process, driven over stdin/stdout with JSON lines (tests only).

The test process never imports SGLang's engine: each Engine lives in a fresh interpreter with the
CPU harness installed (:mod:`.harness`), so tests cannot leak SGLang's process-wide state
(platform, CUDA/CPU flags fixed at import) into each other.

    python -m sglang_tev.testing.sglang_cpu.engine_host '<json Engine kwargs>'

then one JSON command per stdin line; one reply per command on stdout, on a line starting with
:data:`REPLY` (SGLang's own prints go elsewhere or are skipped by the reader):

* ``{"op": "generate", "input_ids": [[...], ...], "sampling_params": [{...}, ...], ...}``: one
  ``Engine.generate`` call (a concurrent batch); extra keys (``return_logprob``,
  ``top_logprobs_num``, ``custom_logit_processor``...) are passed through.
* ``{"op": "staggered", "jobs": [{"delay": s, "input_ids": [...], "sampling_params": {...}}]}``:
  each job starts ``delay`` seconds after the first, through ``async_generate``, so later requests
  arrive while earlier ones decode.
* ``{"op": "server_info"}``: ``Engine.get_server_info()`` (JSON-safe subset).
* ``{"op": "shutdown"}``.

A reply is ``{"ok": true, "result": ...}`` or ``{"ok": false, "error": "<type>: <message>"}``;
an exception inside a request is a reply, not a crash, so a test can check that the Engine is
still serving afterwards.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import traceback

REPLY = "@@tev-engine-host@@ "


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    try:
        import torch

        if isinstance(x, torch.Tensor):
            return x.tolist()
    except ImportError:
        pass
    return repr(x)


def _reply(obj) -> None:
    sys.stdout.write(REPLY + json.dumps(_jsonable(obj)) + "\n")
    sys.stdout.flush()


def _staggered(engine, jobs):
    async def one(job, t0):
        delay = float(job.get("delay", 0.0))
        await asyncio.sleep(max(0.0, t0 + delay - time.monotonic()))
        kw = {k: v for k, v in job.items() if k != "delay"}
        return await engine.async_generate(**kw)

    async def run():
        t0 = time.monotonic()
        return await asyncio.gather(*(one(j, t0) for j in jobs))

    loop = asyncio.get_event_loop()
    return loop.run_until_complete(run())


def main() -> None:
    import sglang

    kwargs = json.loads(sys.argv[1])
    t0 = time.time()
    engine = sglang.Engine(**kwargs)
    _reply({"ok": True, "result": {"started_s": time.time() - t0}})
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "generate":
                result = engine.generate(**cmd)
            elif op == "staggered":
                result = _staggered(engine, cmd["jobs"])
            elif op == "server_info":
                result = engine.get_server_info()
            elif op == "shutdown":
                _reply({"ok": True, "result": None})
                break
            else:
                raise ValueError(f"unknown op {op!r}")
            _reply({"ok": True, "result": result})
        except Exception as e:  # a failed request is reported; the host keeps serving
            traceback.print_exc(file=sys.stderr)
            _reply({"ok": False, "error": f"{type(e).__name__}: {e}"})
    engine.shutdown()


if __name__ == "__main__":
    main()
