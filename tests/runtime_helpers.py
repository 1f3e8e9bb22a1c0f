"""Helpers the transformers-runtime tests share (tests/runtime/): prompts of the tiny random
pair, a character tokenizer, cheap fixed-logit drafters (one row and batched) and the exact law
of the first two sampled tokens, and :class:`Sim`, rows drafted by the fused static runner, an
eager one and per-row reference caches side by side."""

from __future__ import annotations

import torch

from sglang_tev import processed_probs
from sglang_tev.hf.dflash_runner import StaticDFlashDrafter

PROMPTS = [[3, 17, 29, 41, 5], [60, 2, 2, 9, 33, 71, 80, 14, 1, 44, 12], [7]]


class CharTokenizer:
    """A tiny tokenizer: token i decodes to chr(ord('a') + i % 26)."""

    eos_token_id = None
    chat_template = None

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i % 26) for i in ids)


class FixedDrafter:
    """Fixed seeded draft logits: cheap, so thousands of sampled generations stay fast."""

    target_layer_ids = None

    def __init__(self, vocab, block_size, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(1, block_size - 1, vocab, generator=g) * 2
        self.block_size = block_size

    def reset(self):
        pass

    def draft(self, committed, feats, depth):
        return self.logits[:, :depth]


class BatchFixedDrafter:
    """Fixed seeded draft logits for every row (BatchDrafter interface), cheap."""

    target_layer_ids = None
    max_rows = None

    def __init__(self, vocab, block_size, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(1, block_size - 1, vocab, generator=g) * 2
        self.block_size = block_size

    def start(self, rows, max_len, device):
        pass

    def add_context(self, rows, features, positions):
        pass

    def move_row(self, src, dst, length):
        pass

    def draft_rows(self, rows, roots, root_pos, tokens, depth, max_root_pos):
        return self.logits[:, :depth].expand(roots.shape[0], depth, -1)


def exact_two_token_law(tgt, prompt, sampling, vocab):
    with torch.no_grad():
        p1 = processed_probs(tgt(torch.tensor([prompt])).logits[:, -1].double(), sampling)[0]
        seqs = torch.tensor([prompt + [a] for a in range(vocab)])
        p2 = processed_probs(tgt(seqs).logits[:, -1].double(), sampling)
    return (p1[:, None] * p2).numpy()


SIM_BLOCK = 6  # the block size of the drafters Sim drives
# float32 rounding: the runtime's block forward fuses q/k/v and gate/up into one matmul each and
# sums the conv's taps in another order than the model's modules (a real error is O(0.1))
SIM_TOL = dict(rtol=1e-4, atol=5e-5)


class Sim:
    """Rows of random context features, drafted by a fused drafter, an eager one (context written
    at once, block-only forward) and one reference DFlashDraftCache per row."""

    def __init__(self, pair, lens, seed=0, max_len=80):
        self.target, self.dm = pair
        self.g = torch.Generator().manual_seed(seed)
        self.F = self.dm.fc.in_features
        self.fused = StaticDFlashDrafter(self.dm, self.target)
        self.eager = StaticDFlashDrafter(self.dm, self.target)
        for d in (self.fused, self.eager):
            d.start(len(lens), max_len, "cpu")
        self.hist = [self.feats(n) for n in lens]  # row r's committed context features [len_r, F]
        self.fed = [0] * len(lens)  # how many the reference cache of row r has seen
        self.caches = [self.dm.new_cache() for _ in lens]
        t = max(lens)
        feats = torch.stack([torch.cat([h, self.feats(t - len(h))]) for h in self.hist])  # padded
        self.add(slice(0, len(lens)), feats, torch.arange(t).expand(len(lens), t))

    def feats(self, n):
        return torch.randn(n, self.F, generator=self.g)

    def add(self, rows, feats, pos):
        for d in (self.fused, self.eager):
            d.add_context(rows, feats, pos)
        self.eager._flush()
        assert self.eager._pending is None

    def draft(self, rows=None):
        b = len(self.hist)
        rows = slice(0, b) if rows is None else rows
        lens = [len(h) for h in self.hist]
        roots = torch.randint(0, self.target.config.vocab_size - 1, (b,), generator=self.g)
        root_pos = torch.tensor(lens)
        got = self.fused.draft_rows(rows, roots, root_pos, None, SIM_BLOCK - 1, max(lens))
        assert self.fused._pending is None
        eager = self.eager.draft_rows(rows, roots, root_pos, None, SIM_BLOCK - 1, max(lens))
        torch.testing.assert_close(got, eager, **SIM_TOL)
        with torch.inference_mode():
            for r in range(b):
                new = self.hist[r][self.fed[r]:][None]
                want = self.dm.draft_logits(self.target.get_input_embeddings(), self.target.get_output_embeddings(),
                                            roots[r: r + 1], lens[r], new, self.caches[r], block_size=SIM_BLOCK)
                self.fed[r] = lens[r]
                torch.testing.assert_close(got[r: r + 1], want, **SIM_TOL)
        return got

    def commit(self, accepted):
        """Row r accepts ``accepted[r]`` drafts: a path of accepted + 1 features, padded to the
        widest (the padding lands on slots of the next block)."""
        b = len(self.hist)
        w = max(accepted) + 1
        lens = torch.tensor([len(h) for h in self.hist])
        feats = torch.stack([self.feats(w) for _ in range(b)])
        for r in range(b):
            self.hist[r] = torch.cat([self.hist[r], feats[r, : accepted[r] + 1]])
        self.add(slice(0, b), feats, lens[:, None] + torch.arange(w))

    def check_kv(self, drafter):
        """Every row's cached context K/V equal the one-sequence projection of its history."""
        with torch.inference_mode():
            for r, h in enumerate(self.hist):
                want = self.dm._project_context(h[None], torch.arange(len(h)), 1)
                for layer in range(len(self.dm.layers)):
                    k, v = drafter.context_kv(r, len(h), layer)
                    torch.testing.assert_close(k, want[layer][0], **SIM_TOL)
                    torch.testing.assert_close(v, want[layer][1], **SIM_TOL)

    def retire(self, slot):
        """Row ``slot`` leaves; the last row moves into it (as the runtime's _retire)."""
        last = len(self.hist) - 1
        if slot != last:
            for d in (self.fused, self.eager):
                d.move_row(last, slot, len(self.hist[last]))
            self.hist[slot], self.fed[slot], self.caches[slot] = self.hist[last], self.fed[last], self.caches[last]
        for lst in (self.hist, self.fed, self.caches):
            lst.pop()
