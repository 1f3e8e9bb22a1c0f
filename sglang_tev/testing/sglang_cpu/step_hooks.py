"""CPU-harness hooks for measuring and testing TEV rounds (loaded by the harness's
``sitecustomize`` in every process of a server or Engine it starts):

* ``SGLANG_TEV_PLAIN_STEPS=1``: every round ``SGLANG_TEV_BUDGET=auto`` plans becomes a plain step
  for the whole batch (budget 0: nothing drafted, SGLang's DECODE forward). The planner still
  learns from the rounds it ran. What tests compare with SGLang's own plain decoding
  (``tests/engine/test_sglang_server.py``) and ``benchmarks/sglang_step_trace.py`` times.
* ``SGLANG_TEV_RAGGED_CUTS=1``: every tree round of two or more requests under
  ``SGLANG_TEV_BUDGET=auto-ragged`` (calibration rounds included) is cut to distinct per-request
  sizes (request r of b: ``max(1, w * (r + 1) // b)`` nodes of the round's width w >= 2: at least
  two different sizes, the widest w; sizes repeat when b > w), whatever the
  clock says: the planner's own cuts follow measured seconds, so on a loaded machine a short test
  may see none. The planner is told the round it planned (so its calibration ends as usual). What
  the engine tests of the ragged verify run on (``tests/engine/test_sglang_engine.py``).
* ``SGLANG_TEV_STEP_TRACE=<file>``: one line per call of the decode worker's
  ``forward_batch_generation`` (``TEVWorker``, else SGLang's ``TpModelWorker``), appended to the
  file: ``kind t0 t1 mode bs tokens width forward`` (``perf_counter`` seconds; mode ``d`` decode,
  ``x`` prefill or idle; tokens: committed this step, all requests; width: the widest request's
  drafted nodes in a TEV round, 0 for a plain step, -1 where unknown; forward: the seconds spent in
  SGLang's ``ModelRunner.forward`` during the call, target and drafter, so the rest of the call is
  the worker's own work). One line per outermost call: the target calls a TEV round or a TEV
  prefill makes inside it are part of its line. Under ``SGLANG_TEV_BUDGET=auto`` a round's line
  adds ``charged load cost``: the seconds the planner was charged for it, its cost table's load
  of the minute, and the table's fitted cost (``CostTable.cost``, load-free seconds, -1 if none)
  at the round's batch size and the width it was timed as, read after the round, so a benchmark
  can set what the planner reads beside what the rounds took (with ``SGLANG_TEV_RAGGED_CUTS`` the
  width is the forced cut's, not the planner's: the column is not meaningful there).

They act only in processes the CPU harness starts (``SGLANG_TEV_CPU_HARNESS=1`` loads them); the
plain-step plans only on a ``SGLANG_TEV_BUDGET=auto`` server, the ragged cuts only where the layout
is ragged.

Neither changes what a request's tokens are drawn from: a plan only ever selects a tree width.
"""

from __future__ import annotations

import dataclasses
import time

__all__ = ["install_plain_steps", "install_ragged_cuts", "install_step_trace"]

_depth = [0]  # worker calls in progress in this process: only the outermost one is written
_forward_s = [0.0]  # seconds in ModelRunner.forward since the outermost worker call began
_charged: list = [None]  # (charged, load, cost) of the last round ServedBudget.observe closed


def _after_import(module: str, fn) -> None:
    """Run ``fn(module object)`` once ``module`` is imported (the harness's post-import hook, as
    ``tp_trace`` and ``sync_probe`` do): nothing of SGLang is imported at interpreter start."""
    import sys

    from . import harness

    if module in sys.modules:
        fn(sys.modules[module])
    else:
        sys.meta_path.insert(0, harness.PostImport({module: fn}))


def install_plain_steps() -> None:
    """Patch :meth:`sglang_tev.srt.budget.ServedBudget.plan` to plan budget 0 for every request."""
    _after_import("sglang_tev.srt.budget", _patch_plan)


def _patch_plan(budget) -> None:
    original = budget.ServedBudget.plan
    if getattr(original, "_plain_steps", False):
        return

    def plan(self, bs, all_greedy=True):
        p = original(self, bs, all_greedy)
        return dataclasses.replace(p, budgets=(0,) * len(p.budgets), reach_at=(), draft_depth=None)

    plan._plain_steps = True
    budget.ServedBudget.plan = plan


def install_ragged_cuts() -> None:
    """Patch :meth:`sglang_tev.srt.budget.ServedBudget.refine` to cut every ragged tree round of two
    or more requests (calibration, probes and trials included) to the sizes of the module doc, the
    same on every TP rank (a function of the plan only), and :meth:`~ServedBudget.observe` to tell
    the planner the round it planned."""
    _after_import("sglang_tev.srt.budget", _patch_refine)


def _patch_refine(budget) -> None:
    from sglang_tev.plan import RoundPlan, cut_rows

    original, original_observe = budget.ServedBudget.refine, budget.ServedBudget.observe
    if getattr(original, "_ragged_cuts", False):
        return

    def refine(self, plan, tree, drafted, temperatures):
        p, t = original(self, plan, tree, drafted, temperatures)
        n, w = len(p.budgets), p.budget
        if self.layout != "ragged" or n < 2 or w < 2:
            return p, t
        sizes = tuple(max(1, w * (r + 1) // n) for r in range(n))
        cut = RoundPlan(sizes, p.capacity, draft_depth=p.draft_depth, reach_at=p.reach_at)
        self._ragged_cut = (cut, p)
        return cut, cut_rows(t, sizes)

    def observe(self, plan, reach_cum, reach_nodes):
        cut = getattr(self, "_ragged_cut", None)
        self._ragged_cut = None
        if cut is not None and cut[0] is plan:
            plan = cut[1]  # the planner learns from the round it planned
        return original_observe(self, plan, reach_cum, reach_nodes)

    refine._ragged_cuts = True
    budget.ServedBudget.refine = refine
    budget.ServedBudget.observe = observe


def install_step_trace(path: str) -> None:
    """Wrap both decode workers' ``forward_batch_generation`` to append one line per call to ``path``."""

    def wrap(cls, kind: str) -> None:
        original = cls.forward_batch_generation
        if getattr(original, "_step_trace", False):
            return

        def timed(self, batch=None, *args, **kwargs):
            if batch is None or _depth[0]:  # a TEV round's or prefill's own target call: inside its line
                return original(self, batch, *args, **kwargs)
            mode = batch.forward_mode  # read first: a TEV round sets TARGET_VERIFY on the batch
            ext = mode.is_extend() or bool(getattr(batch, "is_extend_in_batch", False)) or mode.is_idle()
            _forward_s[0] = 0.0
            t0 = time.perf_counter()
            _depth[0] += 1
            try:
                res = original(self, batch, *args, **kwargs)
            finally:
                _depth[0] -= 1
            t1 = time.perf_counter()
            bs = len(batch.seq_lens) if batch.seq_lens is not None else 0
            tokens = bs if kind == "plain" or ext else int(res.accept_lens.sum())
            width = 0 if kind == "plain" else -1
            info = getattr(getattr(res, "logits_output", None), "customized_info", None)
            if not ext and isinstance(info, dict) and info.get("tev_budget") is not None:
                width = int(max(info["tev_budget"], default=-1))
            extra = ""
            if _charged[0] is not None and not ext:
                extra = " %.6f %.4f %.6f" % _charged[0]
            _charged[0] = None
            with open(path, "a") as f:
                f.write(f"{kind} {t0:.6f} {t1:.6f} {'x' if ext else 'd'} {bs} {tokens} {width} {_forward_s[0]:.6f}{extra}\n")
            return res

        timed._step_trace = True
        cls.forward_batch_generation = timed

    def wrap_forward(module) -> None:
        cls = module.ModelRunner
        original = cls.forward
        if getattr(original, "_step_trace", False):
            return

        def timed_forward(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                _forward_s[0] += time.perf_counter() - t0

        timed_forward._step_trace = True
        cls.forward = timed_forward

    def wrap_observe(budget) -> None:
        cls = budget.ServedBudget
        original = cls.observe
        if getattr(original, "_step_trace", False):
            return

        def observe(self, plan, reach_cum, reach_nodes):
            charged = original(self, plan, reach_cum, reach_nodes)
            if self.leader:
                table = self.costs
                cost = table.cost(len(plan.budgets), plan.timed_budget)
                _charged[0] = (charged, table._load or 1.0, cost if cost is not None else -1.0)
            return charged

        observe._step_trace = True
        cls.observe = observe

    _after_import("sglang_tev.srt.budget", wrap_observe)
    _after_import("sglang_tev.srt.worker", lambda m: wrap(m.TEVWorker, "tev"))
    _after_import("sglang.srt.managers.tp_worker", lambda m: wrap(m.TpModelWorker, "plain"))
    _after_import("sglang.srt.model_executor.model_runner", wrap_forward)
