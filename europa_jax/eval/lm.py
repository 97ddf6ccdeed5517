"""lm-eval's model interface (`lm_eval.api.model.TemplateLM`) backed by our own forward.

lm-eval turns every task into three kinds of request; this answers them with
eval/forward.py on the run's mesh:
- `loglikelihood(context, continuation)`: tokenized exactly as lm-eval's Hugging Face
  backend does (TemplateLM's `_encode_pair`: the whole string encoded, the context's ids
  split off; trailing spaces of the context moved to the continuation; an empty context
  is the prefix token: BOS if the tokenizer has one, else EOS), then packed many to a row
  (packing.py) and scored in batches: the sum of the continuation's log-probabilities and
  whether each of its tokens is the greedy choice;
- `loglikelihood_rolling(text)`: lm-eval's own rolling windows of the rows' length, each
  scored as above and summed (perplexity tasks);
- `generate_until(context, kwargs)`: greedy, many prompts at a time (generation.py).

Texts are encoded with the run's tokenizer as training encoded them (no special tokens
added), so the ids equal the exported Hugging Face tokenizer's
(interop/hf_tokenizer_files.py). Every process of a job answers every request (lm-eval
sees one process): the rows are sharded over all devices inside the forward.
"""

from __future__ import annotations

from typing import Callable

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM

from europa_jax.eval import generation, packing
from europa_jax.eval.forward import EvalForward
from europa_jax.interop.hf_tokenizer_files import RunTokenizer


class EuropaLM(TemplateLM):
    """A run's model as an lm-eval `LM`; `forward.use(params, bias)` picks the weights."""

    backend = "causal"

    def __init__(self, forward: EvalForward, run_tokenizer: RunTokenizer):
        super().__init__()
        self.forward = forward
        self.run_tokenizer = run_tokenizer
        self.encoder = run_tokenizer.load()
        self.forwards = 0  # forward passes run
        self.on_forward: Callable[[], None] = lambda: None  # after each (the watchdog's)

    # ------------------------------------------------------------------ tokens

    @property
    def eot_token_id(self) -> int:
        return self.run_tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is (lm-eval's HF backend: BOS if there is one, else EOS)."""
        bos = self.run_tokenizer.bos_id
        return self.run_tokenizer.eos_id if bos is None else bos

    @property
    def max_length(self) -> int:
        """The longest input: the evaluation rows' length (contexts are cut from the left)."""
        return self.forward.length

    @property
    def tokenizer_name(self) -> str:
        return str(self.run_tokenizer.path or "bytes")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs) -> list[int]:
        """The ids training saw for this text: no special tokens, whatever is asked."""
        return list(self.encoder.encode(string))

    def tok_decode(self, ids: list[int]) -> str:
        return self.encoder.decode([i for i in ids if i != self.eot_token_id])

    # ------------------------------------------------------------------ requests

    def loglikelihood(self, requests, disable_tqdm: bool = True) -> list[tuple[float, bool]]:
        """TemplateLM's tokenization (as lm-eval's HF backend), without its progress bar."""
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                              ) -> list[tuple[float, bool]]:
        """((context, continuation) strings, context ids, continuation ids) → (sum of the
        continuation's log-probabilities, every token of it greedy)."""
        scored = [packing.scoring(list(context), list(continuation), self.max_length)
                  for _, context, continuation in requests]
        results: list = [None] * len(scored)
        for batch in packing.pack(scored, self.forward.rows, self.forward.length):
            logprob_BS, greedy_BS = self.forward.score(
                batch.tokens_BS, batch.segments_BS, batch.positions_BS, batch.targets_BS)
            packing.totals(batch, logprob_BS, greedy_BS, results)
            self._forwarded()
        for (strings, _, _), answer in zip(requests, results):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over lm-eval's disjoint rolling windows, the first
        conditioned on the prefix token (`lm_eval.utils.get_rolling_token_windows`)."""
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(lm_utils.make_disjoint_window,
                                             lm_utils.get_rolling_token_windows(
                                                 token_list=self.tok_encode(text),
                                                 prefix_token=self.prefix_token_id,
                                                 max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the requests' stop strings."""
        eos_text = self.run_tokenizer.eos_token
        prompts = []
        for i, (context, gen_kwargs) in enumerate(req.args for req in requests):
            until, max_gen_toks = generation.stop_rules(gen_kwargs, eos_text, self.max_length)
            ids = self.tok_encode(context)[-(self.max_length - max_gen_toks):]
            if not ids:  # an empty context: the prefix token, as for log-likelihoods
                ids = [self.prefix_token_id]
            prompts.append(generation.Prompt(index=i, ids=ids, context=len(ids), until=until,
                                             max_gen_toks=max_gen_toks))

        def next_tokens(*rows):
            chosen = self.forward.next_tokens(*rows)
            self._forwarded()
            return chosen

        texts = generation.generate(prompts, next_tokens, self.forward.rows,
                                    self.forward.length, self.eot_token_id, self.tok_decode)
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts

    def _forwarded(self) -> None:
        self.forwards += 1
        self.on_forward()
