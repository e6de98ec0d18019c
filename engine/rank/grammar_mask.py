"""Which tokens a guided request may sample next: the whole vocabulary walked through the
guide's byte automaton at once.

A token is allowed in DFA state s when its bytes lead from s to a live state (one from which
the pattern can still be completed). Walking 248k tokens one by one in Python would take
seconds, so the walk is tensor work, byte by byte: one gather moves every token still walking
through the DFA's transition table at once (rows the lazy DFA had not made yet are made when
a walk reaches them), and the tokens that died or ended drop out (outside a string nearly all
die at their first byte). The mask of a state is cached per guide (packed eight
tokens to a byte, on the device), and a guide per pattern, so the requests of one schema
share the work: the string states of a JSON document, where most of the vocabulary is
allowed, are walked once. (xgrammar precomputes such context-independent token sets per
grammar position; this is the same saving, found lazily.)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from deltaserve.engine.regex_automaton import DEAD, START, ByteAutomaton

MASKS_PER_GUIDE = 2048  # each vocab / 8 bytes on the device: 64 MB for Qwen's 248k tokens
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


class TokenWalk:
    """The vocabulary laid out for walking every token at once: the usable token ids
    (`order`), their lengths, and their bytes end to end (`data`, token k's from `starts[k]`)."""

    def __init__(self, token_bytes: Sequence[bytes | None]) -> None:
        self.token_bytes = list(token_bytes)
        usable = [i for i, b in enumerate(token_bytes) if b]
        self.order = torch.tensor(usable, dtype=torch.int64)
        self.lengths = torch.tensor([len(token_bytes[i]) for i in usable], dtype=torch.int64)
        self.starts = self.lengths.cumsum(0) - self.lengths
        self.data = torch.frombuffer(bytearray(b"".join(token_bytes[i] for i in usable)), dtype=torch.uint8).long()


class Guide:
    """One pattern on rank 0: its automaton, the transition table the walks have filled in,
    and the token masks of the states reached (least recently used dropped past
    MASKS_PER_GUIDE)."""

    def __init__(self, pattern: str, walk: TokenWalk) -> None:
        self.automaton = ByteAutomaton(pattern)
        self._walk = walk
        # flat transition table: [state * 256 + byte] = next state * 256 (the offset of its
        # row, so a walk adds the byte and gathers); a row not made yet holds -(state + 1)
        self._table = torch.zeros(0, dtype=torch.int64)
        self._rows = 0  # states the table has a row (made or marked) for
        self._mark_new_states()
        self._masks: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def advance(self, state: int, token: int) -> int:
        """The state after `token` (DEAD for a token the pattern cannot take, or one that
        writes no bytes)."""
        data = self._walk.token_bytes[token] if 0 <= token < len(self._walk.token_bytes) else None
        return self.automaton.step(state, data) if data else DEAD

    def mask(self, state: int, end_ids: tuple[int, ...], width: int, device: torch.device) -> torch.Tensor:
        """Bool [width] on `device`: the tokens allowed in `state`, and `end_ids` where the
        output may end there. Where nothing else may follow (the output complete, or DEAD
        after a token the mask did not offer), the end ids alone."""
        key = (state, end_ids, width, device)
        packed = self._masks.get(key)
        if packed is None:
            allowed = self.allowed_tokens(state)
            mask = torch.zeros(width + (-width) % 8, dtype=torch.bool)
            n = min(width, allowed.shape[0])
            mask[:n] = allowed[:n]
            if self.automaton.accepting[state] or not mask.any():
                mask[[t for t in end_ids if t < width]] = True
            packed = (mask.view(-1, 8).to(torch.uint8) * _BITS).sum(dim=1, dtype=torch.uint8).to(device)
            self._masks[key] = packed
            while len(self._masks) > MASKS_PER_GUIDE:
                self._masks.popitem(last=False)
        else:
            self._masks.move_to_end(key)
        return unpack(packed, width)

    def allowed_tokens(self, state: int) -> torch.Tensor:
        """Bool [len(vocabulary)] on the CPU: the tokens whose bytes lead from `state` to a
        live state."""
        walk = self._walk
        allowed = torch.zeros(len(walk.token_bytes), dtype=torch.bool)
        if state == DEAD or walk.order.numel() == 0:
            return allowed
        self._mark_new_states()  # `advance` may have made states the table lacks
        # the tokens still walking: their index in `order`, where their next byte is, how
        # many bytes they have left, and the row offset of the state they are in
        token, cursor, left = torch.arange(walk.order.shape[0]), walk.starts.clone(), walk.lengths.clone()
        here = torch.full_like(token, state * 256)
        while True:
            index = here + walk.data[cursor]
            went = self._table[index]
            if went.min() < 0:  # rows not made yet: make them, gather again
                for unmade in (-went[went < 0] - 1).unique().tolist():
                    self._make_row(unmade)
                went = self._table[index]
            ended = left == 1
            allowed[walk.order[token[ended]]] = went[ended] != DEAD
            walking = ((went != DEAD) & ~ended).nonzero().squeeze(1)
            if walking.numel() == 0:
                return allowed
            token, cursor, left, here = token[walking], cursor[walking] + 1, left[walking] - 1, went[walking]

    def _make_row(self, state: int) -> None:
        row = self.automaton.row(state)  # may make new states
        self._mark_new_states()
        self._table[state * 256 : (state + 1) * 256] = torch.tensor(row, dtype=torch.int64) * 256

    def _mark_new_states(self) -> None:
        """Rows for the states the automaton made since the last call, marked not made yet
        (DEAD's row is all DEAD from the start)."""
        states = self.automaton.num_states
        if states <= self._rows:
            return
        if states * 256 > self._table.shape[0]:
            grown = torch.empty(max(states, 2 * self._rows, 64) * 256, dtype=torch.int64)
            grown[: self._table.shape[0]] = self._table
            self._table = grown
        marks = -torch.arange(self._rows, states, dtype=torch.int64) - 1
        self._table[self._rows * 256 : states * 256] = marks.repeat_interleave(256)
        if self._rows == 0:
            self._table[:256] = DEAD
        self._rows = states


def unpack(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Bool [width] from a mask packed eight tokens to a byte, lowest bit first."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)  # made there: no host copy
    return ((packed[:, None] >> shifts) & 1).bool().view(-1)[:width]


__all__ = ["DEAD", "START", "Guide", "TokenWalk", "unpack"]
