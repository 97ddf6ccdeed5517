"""Greedy generation for lm-eval's `generate_until`, many prompts at a time, no KV cache.

Like `sample` (interop/sample.py) every new token is a whole forward over fixed-length
rows (eval/forward.py `next_tokens`): O(length²) work per generated token, fine for
short answers from the models this evaluates during training, not a serving path. Each
row holds one prompt (its tokens in segment 1, padding in segment 0 after them, which the
causal mask never lets a real token see); all rows advance one token per forward, and a
row whose prompt is done — a stop string in its text, EOS, or `max_gen_toks` — takes the
next waiting prompt, so the forwards stay full until the queue runs dry.

What a prompt stops at and how its text is cut are lm-eval's own rules
(`handle_stop_sequences`, `postprocess_generated_text`), as its Hugging Face backend
applies them: the context is cut from the left to `length - max_gen_toks` tokens, EOS
ends the text (and is not part of it), and the text is cut at the first stop string.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np


@dataclasses.dataclass
class Prompt:
    """One request being generated."""

    index: int
    ids: list[int]            # context, then what was generated
    context: int              # how many of `ids` are the context
    until: list[str]          # stop strings (EOS's text included)
    max_gen_toks: int

    @property
    def generated(self) -> list[int]:
        return self.ids[self.context:]


NextTokens = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def generate(prompts: list[Prompt], next_tokens: NextTokens, rows: int, length: int,
             eos_id: int, decode: Callable[[list[int]], str]) -> list[str]:
    """Each prompt's text (cut at its first stop string), in the order given."""
    waiting = list(reversed(prompts))  # pop() takes the first
    active: list[Prompt | None] = [None] * rows
    tokens, segments, positions = (np.zeros((rows, length), np.int32) for _ in range(3))
    texts: list[str] = [""] * len(prompts)
    while True:
        for b in range(rows):  # free rows take the next prompts
            if active[b] is None and waiting:
                p = active[b] = waiting.pop()
                _place(tokens, segments, positions, b, p.ids)
        if all(p is None for p in active):
            return texts
        last = np.array([len(p.ids) - 1 if p else 0 for p in active], np.int32)
        chosen = next_tokens(tokens, segments, positions, last)
        for b, p in enumerate(active):
            if p is None:
                continue
            token = int(chosen[b])
            if token != eos_id:
                p.ids.append(token)
                n = len(p.ids)
                tokens[b, n - 1], segments[b, n - 1], positions[b, n - 1] = token, 1, n - 1
            text = decode(p.generated)
            if (token == eos_id or len(p.generated) >= p.max_gen_toks
                    or len(p.ids) >= length or any(s and s in text for s in p.until)):
                texts[p.index] = cut(text, p.until)
                active[b] = None


def _place(tokens, segments, positions, b: int, ids: list[int]) -> None:
    n = len(ids)
    tokens[b], segments[b], positions[b] = 0, 0, 0
    tokens[b, :n] = ids
    segments[b, :n] = 1
    positions[b, :n] = np.arange(n)


def cut(text: str, until: list[str]) -> str:
    """lm-eval's own cut: the text before the first of its stop strings."""
    from lm_eval.models.utils import postprocess_generated_text

    return postprocess_generated_text(text, until, None)


def stop_rules(gen_kwargs: dict, eos_text: str, length: int) -> tuple[list[str], int]:
    """(stop strings with EOS's text, max_gen_toks) of a request's generation kwargs, as
    lm-eval's backends read them; sampling is refused (this is greedy)."""
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

    kwargs = normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS)
    if kwargs.get("do_sample"):
        raise ValueError(f"generation kwargs {gen_kwargs}: sampling is not supported "
                         "(europa-jax evaluates greedily)")
    until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
    max_gen_toks = int(kwargs["max_gen_toks"])
    if not 0 < max_gen_toks < length:
        raise ValueError(f"max_gen_toks {max_gen_toks} must be in [1, {length}) for "
                         f"evaluation rows of {length} positions")
    return until, max_gen_toks


# lm-eval's Hugging Face backend's default when a task names none (HFLM.max_gen_toks)
DEFAULT_MAX_GEN_TOKS = 256
