"""Guided decoding's algorithms on llguidance, pure functions that the engine and the rank
both import (a leaf: nothing of ours but other leaves). The engine's compile worker
(engine/grammar_worker.py) and cache (engine/guides.py), and the rank's matchers
(engine/rank/grammar_mask.py), stay on their sides.

| module            | what                                                              |
|-------------------|-------------------------------------------------------------------|
| grammar.py        | a request's constraint (choice, regex, JSON schema, grammar,      |
|                   | structural tag) as llguidance's grammar                           |
| gbnf.py           | a GBNF or Lark grammar as Lark                                    |
| structural_tag.py | a structural tag as a grammar                                     |
| stop_regex.py     | stop regexes: their grammar and matchers over the output's bytes  |
| runtime.py        | llguidance's limits, its errors in one line, the byte tokenizer   |
| masks.py          | a token mask applied to logits                                    |
"""
