"""Which tokens a guided request may sample next: the whole vocabulary walked through the
guide's byte automaton at once.

A token is allowed in DFA state s when its bytes lead from s to a live state (one from which
the pattern can still be completed). Walking 248k tokens one by one in Python would take
seconds, so the walk is column-wise tensor work: the tokens sorted longest first, column p
holds byte p of every token at least p + 1 bytes long, and one gather per column moves all
of them through the DFA's transition table at once (the table grows as the walk reaches
states the lazy DFA had not made yet). The mask of a state is cached per guide (packed eight
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

MASKS_PER_GUIDE = 256  # each vocab / 8 bytes on the device: 8 MB for Qwen's 248k tokens
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


class TokenWalk:
    """The vocabulary laid out for walking every token at once: token ids longest first
    (`order`), and per byte position the bytes of the tokens that long (`columns`)."""

    def __init__(self, token_bytes: Sequence[bytes | None]) -> None:
        self.token_bytes = list(token_bytes)
        usable = sorted((i for i, b in enumerate(token_bytes) if b), key=lambda i: -len(token_bytes[i]))
        self.order = torch.tensor(usable, dtype=torch.int64)
        lengths = torch.tensor([len(token_bytes[i]) for i in usable], dtype=torch.int64)
        data = torch.frombuffer(bytearray(b"".join(token_bytes[i] for i in usable)), dtype=torch.uint8)
        starts = lengths.cumsum(0) - lengths
        # lengths fall along `order`, so the tokens longer than p are its first n
        longer = [int((lengths > p).sum()) for p in range(int(lengths[0]) if usable else 0)]
        self.columns: list[torch.Tensor] = [data[starts[:n] + p].long() for p, n in enumerate(longer)]


class Guide:
    """One pattern on rank 0: its automaton, the transition table the walks have filled in,
    and the token masks of the states reached (least recently used dropped past
    MASKS_PER_GUIDE)."""

    def __init__(self, pattern: str, walk: TokenWalk) -> None:
        self.automaton = ByteAutomaton(pattern)
        self._walk = walk
        self._table = torch.zeros((64, 256), dtype=torch.int64)
        self._ready = torch.zeros(64, dtype=torch.bool)
        self._ready[DEAD] = True  # its row: all DEAD
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
        if state == DEAD or not walk.columns:
            return allowed
        at = torch.full((walk.columns[0].shape[0],), state, dtype=torch.int64)
        for column in walk.columns:
            here = at[: column.shape[0]]
            self._fill_rows(here)
            at[: column.shape[0]] = self._table[here, column]
        allowed[walk.order] = at != DEAD
        return allowed

    def _fill_rows(self, states: torch.Tensor) -> None:
        """Make the DFA rows of `states` that the table does not hold yet."""
        missing = states[~self._ready[states]]
        if missing.numel() == 0:
            return
        for state in missing.unique().tolist():
            row = self.automaton.row(state)
            if self.automaton.num_states > self._table.shape[0]:  # the row made new states
                grow = max(self.automaton.num_states, 2 * self._table.shape[0]) - self._table.shape[0]
                self._table = torch.cat([self._table, torch.zeros((grow, 256), dtype=torch.int64)])
                self._ready = torch.cat([self._ready, torch.zeros(grow, dtype=torch.bool)])
            self._table[state] = torch.tensor(row, dtype=torch.int64)
            self._ready[state] = True


def unpack(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Bool [width] from a mask packed eight tokens to a byte, lowest bit first."""
    bits = _BITS.to(packed.device)
    return ((packed[:, None] & bits) != 0).view(-1)[:width]


__all__ = ["DEAD", "START", "Guide", "TokenWalk", "unpack"]
