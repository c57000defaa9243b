"""Draft trees: which drafted nodes to verify (SGLang's selection), their attention mask, the accepted path.

A verification block is [root, node_1 .. node_N]: the root is the last emitted token (not yet in the target's
cache), nodes are drafted tokens, parents before children. Block index 0 is the root, node i is block index i+1.
A chain is the tree whose every node is the child of the previous one.

Selection as SGLang's EAGLE worker builds it (select_top_k_tokens, organize_draft_results): draft step 0 scores the
root's top-k children by their draft probability; each later step expands every one of the current top-k beams
into its top-k children, scored by the product of draft probabilities along the path, and the best top-k of
those become the next beams. Every scored candidate is recorded; the tree is the `size` best by score. A child's
score never exceeds its parent's, and ties go to the earlier record, so every kept node's parent is kept too.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    tokens: list[int]  # [N] drafted target ids, parents before children
    parents: list[int]  # [N] block index of each node's parent (0 = the root)
    q: torch.Tensor | None = None  # [N, V] the distribution each node was sampled from (probabilistic chains)

    @classmethod
    def chain(cls, tokens: list[int], q: torch.Tensor | None = None) -> DraftTree:
        return cls(tokens, list(range(len(tokens))), q)

    def depths(self) -> list[int]:
        """Depth of every block index: the root 0, its children 1, ..."""
        depth = [0]
        for parent in self.parents:
            depth.append(depth[parent] + 1)
        return depth

    def ancestor_mask(self) -> torch.Tensor:
        """[N+1, N+1] bool: block i may attend to block j iff j is i or one of its ancestors."""
        n = len(self.tokens) + 1
        mask = torch.zeros(n, n, dtype=torch.bool)
        mask[0, 0] = True
        for i, parent in enumerate(self.parents, start=1):
            mask[i] = mask[parent]
            mask[i, i] = True
        return mask

    def walk(self, choose: Callable[[int], int]) -> tuple[list[int], int]:
        """Follow the target from the root: `choose(block)` is the target's token after that block (its argmax,
        or a sample of p); while it is a drafted child, step into it. Returns (path of block indices from the
        root, the first token off the tree: the correction or, at a leaf, the bonus). Children are distinct
        tokens, so each target sample matches at most one."""
        children: dict[tuple[int, int], int] = {(parent, token): i for i, (parent, token)
                                                in enumerate(zip(self.parents, self.tokens), start=1)}
        path = [0]
        while True:
            token = choose(path[-1])
            child = children.get((path[-1], token))
            if child is None:
                return path, token
            path.append(child)


@dataclass
class Candidates:
    """Every scored draft candidate of one drafting round, in the order they were drafted."""
    tokens: list[int]
    scores: list[float]  # product of draft probabilities from the root
    parents: list[int]  # index of the parent candidate, -1 = the root

    def best(self, size: int) -> DraftTree:
        """The `size` best candidates as a tree (SGLang's top-(num_draft_tokens - 1) selection)."""
        order = torch.tensor(self.scores).sort(descending=True, stable=True).indices[:size]
        keep = sorted(order.tolist())
        block = {index: b for b, index in enumerate(keep, start=1)}
        return DraftTree([self.tokens[i] for i in keep],
                         [0 if self.parents[i] < 0 else block[self.parents[i]] for i in keep])
