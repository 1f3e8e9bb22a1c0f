"""Where one round's draft tree loses target mass (the paper's Fig. 1, for a user's own pair):
the canonical exit law of the first round's tree, node by node, and per-depth exit mass over a
prompt set (``sglang-tev draw-tree``; docs/cli.md).

The round is the transformers runtime's first round on a prompt: the root is the prompt's last
token (the prefill covers the prompt minus it), the drafter reads the target features of the
tokens strictly before it, and the tree is the inference builder's (DDTree over the draft
marginals, the lattice DDTree over a DFlash2 selector, or the greedy chain), without stop-token
leaves (as ``--ignore-eos``). It is computed by ``eval-drafter``'s fixed-context pipeline at one
anchor (:func:`~.metrics.draft_blocks` -> :func:`~.exit.anchor_trees` -> the target's tree pass
:func:`~.exit.iter_tree_logits` -> :func:`~.exit.target_law` at temperature T), and the numbers
are the core's: :func:`sglang_tev.tree.exit_law` (paper Eq. 2, 4; Lemma 1) for the reach P(v), the
residual rho(v) and the exit mass w(v) = P(v)·rho(v), :func:`sglang_tev.tree.residual_probs`
(Eq. 7) for the bonus law where the target leaves the tree, :func:`~.metrics.exit_breakdown` for
the mass by depth and node kind.

The exit node drawn is the MOST LIKELY one, ``argmax_v w(v)`` (ties: the lower node index), not a
sample: the picture is deterministic. The target's preferred token there is ``argmax p_v^res``
(ties: the lower token id), the most likely bonus token of a round that exits at v.

Drawing (:func:`draw_round_trees`, :func:`draw_exit_bars`) is separate from the numbers and
imports matplotlib only when called.
"""

from __future__ import annotations

import html
import io
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch

__all__ = ["NODE_KINDS", "NodeExit", "RoundTree", "round_trees", "mean_exit_mass", "token_label",
           "draw_round_trees", "draw_exit_bars", "render", "write_outputs", "FIGURE_SUFFIXES"]

NODE_KINDS = ("root", "inner", "cut", "horizon")
"""Node kinds, as :class:`~.metrics.TreeBreakdown`: the root; ``inner``: a non-root node with drafted
children below the horizon; ``cut``: a leaf above the horizon (the budget stopped expanding it);
``horizon``: a node at the maximum draft depth H = K - 1 (the block's end)."""

FIGURE_SUFFIXES = (".svg", ".png", ".html")


@dataclass(frozen=True)
class NodeExit:
    """One node of a round's draft tree and its exit law (paper Eq. 2, 4).

    Attributes:
        index: node index in the tree (0 = root; parents precede children).
        parent: parent index (-1 at the root).
        depth: 0 at the root.
        token: the drafted token id (the root: the last prompt token); text: its decoded text.
        P: reach P(v), the probability that a target continuation reaches v (1 at the root).
        rho: residual rho(v) = 1 - Σ_{children u} p_v(x_u), the target's next-token mass at v
            outside the drafted children (1 at a leaf).
        w: exit mass w(v) = P(v)·rho(v), the probability that the target leaves the tree at v.
        kind: one of :data:`NODE_KINDS`.
        target_token, target_text, target_prob: the target's most likely next token at v
            (argmax p_v, ties to the lower id) and its probability p_v(target_token).
    All probabilities are float64 values of the processed target law at the round's temperature.
    """

    index: int
    parent: int
    depth: int
    token: int
    text: str
    P: float
    rho: float
    w: float
    kind: str
    target_token: int
    target_text: str
    target_prob: float


@dataclass(frozen=True)
class RoundTree:
    """One round's draft tree with its exit law.

    Attributes:
        prompt_id: the prompt's name; drafter: the drafter's name; tree_mode: ``marginal``,
            ``lattice`` or ``chain``.
        budget: B (non-root nodes at most; ``chain``: K - 1 nodes whatever B).
        temperature: the target law's (below 1e-5: the greedy law, one-hot at the argmax).
        horizon: H = K - 1, the drafter's maximum draft depth.
        context_len: prompt tokens; the root is the last of them, at position context_len - 1.
        nodes: the tree's valid nodes, in tree order (``nodes[i].index == i``).
        exit_node: ``argmax_v w(v)``, the most likely exit node (ties: lower index).
        exit_token, exit_text, exit_prob: the target's preferred token where it leaves the tree
            there: ``argmax p_{exit}^res`` (Eq. 7; ties: lower id) and its residual probability.
        coverage: C_p = Σ_{u≠root} P(u) (Eq. 6); 1 + C_p is the exact expected block length of a
            saturated exact verifier (TEV, predraw, sequential) on this tree (Theorem 1).
        w_depth: exit mass by depth 0..H (H + 1 floats, summing to 1).
        w_kind: exit mass by node kind, ``{kind: float}`` over :data:`NODE_KINDS` (summing to 1).
    """

    prompt_id: str
    drafter: str
    tree_mode: str
    budget: int
    temperature: float
    horizon: int
    context_len: int
    nodes: tuple[NodeExit, ...]
    exit_node: int
    exit_token: int
    exit_text: str
    exit_prob: float
    coverage: float
    w_depth: tuple[float, ...]
    w_kind: dict = field(default_factory=dict)

    @property
    def block_len(self) -> float:
        """1 + C_p."""
        return 1.0 + self.coverage

    @property
    def name(self) -> str:
        """``drafter[tree_mode]``, as ``eval-drafter``'s rows."""
        return f"{self.drafter}[{self.tree_mode}]"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["nodes"] = [asdict(n) for n in self.nodes]
        d["block_len"] = self.block_len
        return d


def token_label(text: str, limit: int = 12) -> str:
    """A token's text as drawn: newline ``\\n``, tab ``\\t``, space ``␣``, other control characters as
    ``\\xNN``, cut to ``limit`` characters with ``…``."""
    out = []
    for ch in text:
        if ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == " ":
            out.append("␣")
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    s = "".join(out)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _node_kinds(parents: list[int], depth: list[int], horizon: int) -> list[str]:
    """Kinds by the rules of :func:`~.metrics.exit_breakdown` (horizon first, then children)."""
    has_child = [False] * len(parents)
    for p in parents[1:]:
        has_child[p] = True
    return ["root" if v == 0 else "horizon" if depth[v] == horizon else "inner" if has_child[v] else "cut"
            for v in range(len(parents))]


@torch.no_grad()
def round_trees(target, tokenizer, drafters: Sequence, prompt_ids: Sequence[Sequence[int]], *, budget: int,
                temperature: float = 0.0, tree_modes: Sequence | None = None, names: Sequence[str] | None = None,
                prompt_names: Sequence[str] | None = None) -> list[list[RoundTree]]:
    """The first round's draft tree of every drafter on every prompt, with its exit law.

    Args:
        target: the frozen HF causal LM (sdpa / eager attention, full attention layers:
            :func:`~.exit.check_tree_support`), e.g. from :func:`~.drafter_eval.load_models`.
        tokenizer: decodes the tokens drawn (None: labels are ``#id``).
        drafters: :class:`~sglang_tev.draft.dflash.DFlashDraftModel` s (DFlash v1 or DFlash2)
            fitting the target.
        prompt_ids: token ids per prompt (each at least 1 token; the last is the root), with
            ``len(ids) - 1 + K - 1 < `` the target's and the drafter's positions.
        budget: the DDTree budget B, in [0, MAX_BUDGET].
        temperature: the target law's temperature (finite, >= 0; below 1e-5 the greedy law).
        tree_modes: per drafter a mode or a list of modes, each ``auto`` or one of
            :data:`~sglang_tev.spec.TREE_MODES` (``auto``: ``lattice`` for a DFlash2 drafter with a
            selector, else ``marginal``); None = ``auto`` for every drafter.
        names: the drafters' names (default ``draft0``, ``draft1``, ...); prompt_names: the
            prompts' (default their index).
    Returns:
        one list per (drafter, resolved mode), drafter-major, modes in the order given; each holds
        one :class:`RoundTree` per prompt, in prompt order.
    Raises:
        ValueError naming ``tree_modes`` (wrong length, unknown mode, ``lattice`` without a
        selector), ``prompt_ids`` (an empty prompt, one past the positions), ``budget`` or
        ``temperature`` (out of range).
    Cost: one target forward over each prompt, then per (drafter, mode) one block forward and one
    tree pass of B query rows over the prompt's KV.
    """
    from transformers import DynamicCache

    from ..compat import cache_kwargs
    from ..draft.dflash import extract_context_features
    from ..spec import MAX_BUDGET
    from ..tree import exit_law, residual_probs
    from .drafter_eval import _tree_modes_of
    from .exit import anchor_trees, iter_tree_logits, kv_reuse_forward, target_law
    from .metrics import draft_blocks, exit_breakdown
    from .target import text_config

    if isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget <= MAX_BUDGET:
        raise ValueError(f"budget must be an int in [0, {MAX_BUDGET}], got {budget!r}")
    target_law(torch.zeros(1, 1), temperature)  # a bad temperature fails before any forward
    if tree_modes is None:
        tree_modes = ["auto"] * len(drafters)
    if isinstance(tree_modes, str) or len(tree_modes) != len(drafters):
        raise ValueError(f"tree_modes: expected one entry per drafter ({len(drafters)}), got {tree_modes!r}")
    modes = [_tree_modes_of(d, m) for d, m in zip(drafters, tree_modes)]
    names = list(names) if names is not None else [f"draft{i}" for i in range(len(drafters))]
    prompt_names = list(prompt_names) if prompt_names is not None else [str(i) for i in range(len(prompt_ids))]
    max_pos = int(getattr(text_config(target), "max_position_embeddings", 1 << 30))
    for ids, pname in zip(prompt_ids, prompt_names):
        if not len(ids):
            raise ValueError(f"prompt_ids: {pname}: the prompt has no tokens")
        for d in drafters:
            lim = min(max_pos, int(getattr(d.config, "max_position_embeddings", max_pos)))
            if len(ids) - 1 + d.config.block_size - 1 >= lim:
                raise ValueError(f"prompt_ids: {pname}: {len(ids)} prompt tokens + the block of "
                                 f"{d.config.block_size} exceed the {lim} positions of the models; shorten it")

    def text_of(tok: int) -> str:
        return tokenizer.decode([tok]) if tokenizer is not None else f"#{tok}"

    decoder, embed, head = target.get_decoder(), target.get_input_embeddings(), target.get_output_embeddings()
    mask_dtype = next(target.parameters()).dtype
    dev = next(target.parameters()).device
    rows: list[list[RoundTree]] = [[] for d in modes for _ in d]
    for ids, pname in zip(prompt_ids, prompt_names):
        x = torch.tensor([list(ids)], dtype=torch.int64, device=dev)
        anchors = torch.tensor([[x.shape[1] - 1]], device=dev)        # the root: the prompt's last token
        keep = torch.ones_like(anchors, dtype=torch.bool)
        cache = DynamicCache()
        out = decoder(input_ids=x, output_hidden_states=True, use_cache=True, **cache_kwargs(decoder, cache))
        r = 0
        for draft, dmodes, dname in zip(drafters, modes, names):
            K = draft.config.block_size
            has_selector = getattr(draft.config, "selector_rank", None) is not None
            block_mode = "lattice" if has_selector and any(m in ("lattice", "chain") for m in dmodes) else "marginal"
            feats = extract_context_features(out.hidden_states, draft.config.target_layer_ids)
            logits, _, lattice = draft_blocks(draft, embed, head, feats, x, anchors, keep, K, block_mode)
            logits = logits.reshape(1, K - 1, -1)
            for mode in dmodes:
                tree = anchor_trees(logits, budget, x[:, -1], keep.reshape(-1),
                                    lattice=lattice if mode != "marginal" else None, mode=mode)
                (_, sub, tl), = iter_tree_logits(kv_reuse_forward(decoder, cache), head, out.last_hidden_state,
                                                 tree, anchors, 1, mask_dtype)
                probs = target_law(tl.double(), temperature)                       # [1, N, V] float64
                law = exit_law(sub, probs, validate=False)
                br = exit_breakdown(sub, law, K - 1)
                n = int(sub.valid[0].sum())
                w = law.w[0, :n]
                v_exit = int(torch.argmax(w))                                      # first maximum
                res = residual_probs(sub, probs, torch.tensor([v_exit], device=dev))[0]
                y = int(torch.argmax(res))
                top_p, top = probs[0, :n].max(-1)
                parents = sub.parents[0, :n].tolist()
                depth = sub.depth[0, :n].tolist()
                tokens = sub.tokens[0, :n].tolist()
                kinds = _node_kinds(parents, depth, K - 1)
                P, rho = law.P[0, :n].tolist(), law.rho[0, :n].tolist()
                nodes = tuple(NodeExit(i, parents[i], depth[i], tokens[i], text_of(tokens[i]), P[i], rho[i],
                                       float(w[i]), kinds[i], int(top[i]), text_of(int(top[i])), float(top_p[i]))
                              for i in range(n))
                rows[r].append(RoundTree(
                    prompt_id=str(pname), drafter=dname, tree_mode=mode, budget=budget,
                    temperature=float(temperature), horizon=K - 1, context_len=x.shape[1], nodes=nodes,
                    exit_node=v_exit, exit_token=y, exit_text=text_of(y), exit_prob=float(res[y]),
                    coverage=float(law.coverage[0]), w_depth=tuple(br.w_depth[0].tolist()),
                    w_kind={"root": float(br.w_root[0]), "inner": float(br.w_inner[0]),
                            "cut": float(br.w_cut[0]), "horizon": float(br.w_horizon[0])}))
                r += 1
    return rows


def mean_exit_mass(rounds: Sequence[RoundTree]) -> dict:
    """Mean over prompts of one row's rounds: ``{"w_depth": [H + 1], "w_kind": {kind: float},
    "block_len": float, "prompts": int}`` (each round weighs the same). Raises ValueError naming
    ``rounds`` when empty or mixing drafters / modes."""
    if not rounds:
        raise ValueError("rounds: no rounds")
    if len({r.name for r in rounds}) != 1:
        raise ValueError(f"rounds: mixes rows {sorted({r.name for r in rounds})}")
    m = len(rounds)
    H = max(len(r.w_depth) for r in rounds)
    w_depth = [sum(r.w_depth[d] for r in rounds if d < len(r.w_depth)) / m for d in range(H)]
    return {"w_depth": w_depth, "w_kind": {k: sum(r.w_kind[k] for r in rounds) / m for k in NODE_KINDS},
            "block_len": sum(r.block_len for r in rounds) / m, "prompts": m}


# ----------------------------------------------------------------------------------------------
# drawing (matplotlib, imported on use)
# ----------------------------------------------------------------------------------------------

def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _layout(nodes: Sequence[NodeExit], ghost_parent: int | None = None) -> dict[int, tuple[float, float]]:
    """x = depth, y = leaf order of a depth-first walk (children by descending reach, then
    index), a parent at the mid-point of its children: node -> (x, y), y growing downwards.
    ``ghost_parent``: also place a last child of that node, key -1 (where the target's token
    outside the tree is drawn), so it gets a row of its own."""
    children: dict[int, list[int]] = {n.index: [] for n in nodes}
    for n in nodes[1:]:
        children[n.parent].append(n.index)
    for c in children.values():
        c.sort(key=lambda i: (-nodes[i].P, i))
    if ghost_parent is not None:
        children[ghost_parent].append(-1)
        children[-1] = []
    pos: dict[int, tuple[float, float]] = {}
    nxt = [0.0]

    def place(v: int, depth: int) -> float:
        if not children[v]:
            y = nxt[0]
            nxt[0] += 1.0
        else:
            ys = [place(u, depth + 1) for u in children[v]]
            y = (ys[0] + ys[-1]) / 2
        pos[v] = (float(depth), y)
        return y

    place(0, 0)
    return pos


def _fmt(x: float) -> str:
    """A probability in 3 significant digits, small ones in scientific notation."""
    if x == 0:
        return "0"
    return f"{x:.3f}" if x >= 0.001 else f"{x:.1e}"


def draw_round_trees(rounds: Sequence[RoundTree], title: str | None = None):
    """One panel per round (e.g. one per drafter on the same prompt): the tree laid out by depth
    (left to right), each node labelled with its token and ``P``, ``rho``, ``w``; node area and
    colour by w(v) (colour relative to the panel's largest w); edge width by the target flow
    P(child); the most likely exit node ringed in red, with the target's preferred token there
    drawn outside the tree (a dashed red edge to a dashed box).

    Returns the matplotlib Figure (the caller saves it: :func:`render`)."""
    plt = _plt()
    from matplotlib import colormaps

    layouts = [_layout(r.nodes, r.exit_node) for r in rounds]
    heights = [max(1.6, 0.55 * (max(y for _, y in pos.values()) + 1) + 0.9) for pos in layouts]
    depth = max(max(x for x, _ in pos.values()) for pos in layouts)
    fig, axes = plt.subplots(len(rounds), 1, figsize=(max(6.0, 1.5 * depth + 2.6), sum(heights) + 0.5),
                             squeeze=False, gridspec_kw={"height_ratios": heights})
    cmap = colormaps["OrRd"]
    red = "#d62728"
    for ax, r, pos in zip(axes[:, 0], rounds, layouts):
        w_max = max(n.w for n in r.nodes) or 1.0
        for n in r.nodes[1:]:
            (x0, y0), (x1, y1) = pos[n.parent], pos[n.index]
            ax.plot([x0, x1], [y0, y1], color="#3b6fb6", lw=0.5 + 5.0 * n.P, alpha=0.3 + 0.7 * n.P, zorder=1,
                    solid_capstyle="round")
        (x0, y0), (xg, yg) = pos[r.exit_node], pos[-1]
        ax.plot([x0, xg - 0.28], [y0, yg], color=red, lw=1.2, ls="--", zorder=1)
        ax.text(xg - 0.26, yg, f"target: {token_label(r.exit_text)}\np_res {_fmt(r.exit_prob)}", ha="left",
                va="center", fontsize=7, color=red, family="monospace", parse_math=False, zorder=5,
                bbox=dict(boxstyle="round,pad=0.25", fc="white", ec=red, ls="--", lw=0.8))
        for n in r.nodes:
            x, y = pos[n.index]
            ax.scatter([x], [y], s=36 + 300 * n.w, color=cmap(0.12 + 0.88 * n.w / w_max), edgecolors="#333333",
                       linewidths=0.6, zorder=2)
            ax.text(x, y - 0.2, token_label(n.text), ha="center", va="bottom", fontsize=8, family="monospace",
                    parse_math=False, zorder=3)
            ax.text(x, y + 0.2, f"P {_fmt(n.P)}  ρ {_fmt(n.rho)}\nw {_fmt(n.w)}", ha="center", va="top",
                    fontsize=6, color="#444444", parse_math=False, zorder=3)
        xe, ye = pos[r.exit_node]
        ax.scatter([xe], [ye], s=36 + 300 * r.nodes[r.exit_node].w + 130, facecolors="none", edgecolors=red,
                   linewidths=2.0, zorder=4)
        law = "greedy law" if r.temperature < 1e-5 else f"T = {r.temperature:g}"
        e = r.nodes[r.exit_node]
        ax.set_title(f"{r.name}, budget {r.budget}, {law}: 1 + C_p = {r.block_len:.3f}; most likely exit node "
                     f"{r.exit_node} (depth {e.depth}, w {_fmt(e.w)}), root w {_fmt(r.nodes[0].w)}",
                     fontsize=8, loc="left", parse_math=False)
        ys = [p[1] for p in pos.values()]
        ax.set_xlim(-0.5, depth + 0.9)
        ax.set_ylim(max(ys) + 0.75, min(ys) - 0.75)
        ax.set_xticks(range(int(depth) + 1))
        ax.set_xlabel("depth", fontsize=7)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_yticks([])
        for s in ("top", "right", "left"):
            ax.spines[s].set_visible(False)
    fig.text(0.01, 0.005, "node area and colour: exit mass w(v) = P(v)·ρ(v); edge width: reach P(child); red ring: "
             "the most likely exit node, dashed box: the target's preferred next token there (argmax of the "
             "residual p_res)", fontsize=6, color="#555555", parse_math=False)
    top = 1.0
    if title:
        fig.suptitle(title, fontsize=9, x=0.01, ha="left", parse_math=False)
        top = 1.0 - 0.3 / fig.get_figheight()
    fig.tight_layout(rect=(0, 0.02, 1, top))
    return fig


def draw_exit_bars(rows: Sequence[Sequence[RoundTree]], title: str | None = None):
    """Exit mass per depth (left) and per node kind (right), mean over each row's prompts, one bar
    per row (drafter, mode) side by side; the legend gives each row's mean 1 + C_p. Returns the
    Figure."""
    plt = _plt()
    means = [mean_exit_mass(r) for r in rows]
    # depths 0 .. the deepest node of any tree (deeper ones hold no mass)
    H = 1 + max(max(n.depth for n in rt.nodes) for r in rows for rt in r)
    k = len(rows)
    wd = 0.8 / k
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(max(7.0, 0.3 * H * max(k, 2) + 4.5), 3.4),
                                  gridspec_kw={"width_ratios": [max(H, 4), 4]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, (r, m) in enumerate(zip(rows, means)):
        off = (j - (k - 1) / 2) * wd
        c = colors[j % len(colors)]
        ax.bar([d + off for d in range(H)], m["w_depth"][:H], wd, color=c,
               label=f"{r[0].name} (1 + C_p {m['block_len']:.3f})")
        ax2.bar([i + off for i in range(len(NODE_KINDS))], [m["w_kind"][kd] for kd in NODE_KINDS], wd, color=c)
    r0 = rows[0][0]
    law = "greedy law" if r0.temperature < 1e-5 else f"T = {r0.temperature:g}"
    ax.set_title(f"exit mass by depth, mean over {means[0]['prompts']} prompt(s): budget {r0.budget}, {law}",
                 fontsize=8, loc="left")
    ax.set_xlabel("exit depth (0 = root)", fontsize=7)
    ax.set_ylabel("mean exit mass w", fontsize=7)
    ax.set_xticks(range(H))
    ax2.set_xticks(range(len(NODE_KINDS)), ["root", "inner", "budget cut", "horizon"])
    ax2.set_title("by node kind", fontsize=8, loc="left")
    for a in (ax, ax2):
        a.tick_params(labelsize=7)
        a.grid(axis="y", alpha=0.3)
        a.set_axisbelow(True)
    ax.legend(fontsize=7)
    top = 1.0
    if title:
        fig.suptitle(title, fontsize=9, x=0.01, ha="left", parse_math=False)
        top = 1.0 - 0.3 / fig.get_figheight()
    fig.tight_layout(rect=(0, 0, 1, top))
    return fig


def _svg_bytes(fig) -> bytes:
    plt = _plt()
    buf = io.BytesIO()
    # text stays text (small, searchable files); fixed ids and no date: a rerun gives the same bytes
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "sglang-tev"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    return buf.getvalue()


def _html_table(rounds: Sequence[RoundTree]) -> str:
    cols = ("index", "parent", "depth", "text", "P", "rho", "w", "kind", "target_text", "target_prob")
    parts = []
    for r in rounds:
        parts.append(f"<h3>{html.escape(r.name)}: prompt {html.escape(r.prompt_id)}, exit node {r.exit_node}, "
                     f"target's token there {html.escape(repr(r.exit_text))} (p_res {r.exit_prob:.4g}), "
                     f"1 + C_p = {r.block_len:.4f}</h3>")
        parts.append("<table><tr>" + "".join(f"<th>{c}</th>" for c in cols) + "</tr>")
        for n in r.nodes:
            cells = [n.index, n.parent, n.depth, repr(n.text), f"{n.P:.6g}", f"{n.rho:.6g}", f"{n.w:.6g}", n.kind,
                     repr(n.target_text), f"{n.target_prob:.4g}"]
            style = ' style="background:#fde0dd"' if n.index == r.exit_node else ""
            parts.append(f"<tr{style}>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
        parts.append("</table>")
    return "\n".join(parts)


def render(fig, suffix: str, rounds: Sequence[RoundTree] = ()) -> bytes:
    """The bytes of ``fig`` as ``.svg`` or ``.png`` (110 dpi), or ``.html``: the SVG inline and,
    for each of ``rounds``, a table of its nodes' numbers. Closes ``fig``. Raises ValueError naming
    ``suffix`` for another suffix."""
    plt = _plt()
    try:
        if suffix == ".svg":
            return _svg_bytes(fig)
        if suffix == ".png":
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
            return buf.getvalue()
        if suffix == ".html":
            svg = _svg_bytes(fig).decode()
            svg = svg[svg.index("<svg"):]                     # drop the XML prolog and doctype
            style = ("body{font-family:sans-serif;font-size:13px}table{border-collapse:collapse;margin-bottom:2em}"
                     "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}")
            return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>sglang-tev draw-tree</title>"
                    f"<style>{style}</style></head><body>\n{svg}\n{_html_table(rounds)}\n</body></html>\n").encode()
        raise ValueError(f"suffix must be one of {FIGURE_SUFFIXES}, got {suffix!r}")
    finally:
        plt.close(fig)


def write_outputs(files: dict) -> None:
    """Write ``{path: bytes}`` each atomically (a reader never sees a partial file)."""
    from ..atomic import atomic_write

    for path, data in files.items():
        atomic_write(Path(path), data)
