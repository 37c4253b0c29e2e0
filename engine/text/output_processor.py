"""Text for the engine's token outputs, made outside the engine thread: incremental detokenization (never half a
character) and stop strings. A stop string ends the sequence here, at once, and the caller aborts it in the engine;
outputs the engine produced for it meanwhile are dropped.

`CompletionOutput` accumulates one sequence's deltas into its whole output (the offline API and the server both
use it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.text.detokenizer import IncrementalDetokenizer, StopStringMatcher, SupportsDecode
from engine.outputs import FinishReason, SequenceOutput, TokenLogprobs
from engine.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    """One sequence's output so far."""

    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # `SamplingParams.prompt_logprobs` (index 0)
    stop_str: str | None = None  # the stop string that ended it

    def add(self, out: SequenceOutput) -> None:
        self.token_ids += out.new_token_ids
        self.text += out.new_text
        self.logprobs += out.new_logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_str = out.stop_str


@dataclass
class _SequenceText:
    detok: IncrementalDetokenizer
    stops: StopStringMatcher | None
    deferred: bool  # its text is made once, when it finishes (see OutputProcessor)
    done: bool = False


@dataclass
class _RequestText:
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: dict[int, _SequenceText] = field(default_factory=dict)  # by index (n > 1)
    num_done: int = 0  # of its sequences


class OutputProcessor:
    """Turns token outputs into text outputs for the requests registered with it. Not thread-safe: one thread (the
    caller's, or the event loop) uses one processor.

    ``final_text_only``: the caller reads each sequence's text only once it finished (the offline API). A sequence
    with no stop strings then gets all of its text in its last output, decoded once (the same text: the deltas of an
    incremental detokenizer add up to the decode of the whole output), instead of one delta per step; a sequence with
    stop strings is still detokenized step by step, since its matching needs the text as it grows."""

    def __init__(self, tokenizer: SupportsDecode, final_text_only: bool = False) -> None:
        self.tokenizer = tokenizer
        self.final_text_only = final_text_only
        self._requests: dict[str, _RequestText] = {}
        self._token_texts: dict[bool, dict[int, str]] = {True: {}, False: {}}  # by skip_special_tokens

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._requests[request_id] = _RequestText(prompt_token_ids, params)

    def process(self, outputs: list[SequenceOutput]) -> tuple[list[SequenceOutput], list[tuple[str, int]]]:
        """Fill in each output's text; returns the outputs to deliver and the (request id, index) of the sequences
        a stop string ended, which the caller must stop in the engine."""
        delivered: list[SequenceOutput] = []
        stopped: list[tuple[str, int]] = []
        requests = self._requests
        for out in outputs:
            request = requests.get(out.request_id)
            if request is None:
                continue
            seq = request.sequences.get(out.index) or self._sequence(request, out.index)
            if seq.done:  # ended by a stop string; the engine had already produced more
                continue
            tokens = out.new_token_ids
            if out.finish_reason is None and seq.stops is None and len(tokens) == 1:  # a decode's row: the most
                if seq.deferred:  # common by far, and nothing to match or release
                    seq.detok.extend(tokens)
                else:
                    out.new_text = seq.detok.add(tokens[0])
                delivered.append(out)
                continue
            if self._fill_text(seq, out):
                stopped.append((out.request_id, out.index))
            delivered.append(out)
            if out.finished:
                seq.done = True
                request.num_done += 1
                if request.num_done == request.params.n:
                    del requests[out.request_id]
        return delivered, stopped

    def _sequence(self, request: _RequestText, index: int) -> _SequenceText:
        seq = request.sequences.get(index)
        if seq is None:
            params = request.params
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens,
                                           self._token_texts[params.skip_special_tokens])
            seq = _SequenceText(detok, StopStringMatcher(params.stop) if params.stop else None,
                                deferred=self.final_text_only and not params.stop)
            request.sequences[index] = seq
        return seq

    @staticmethod
    def _fill_text(seq: _SequenceText, out: SequenceOutput) -> bool:
        """Set ``out.new_text``; True when a stop string ended the sequence (its finish reason becomes STOP)."""
        stop_token = out.finish_reason is FinishReason.STOP  # the engine stops on tokens only: no text for it
        # one token, or several with speculative decoding (accepted drafts, then the model's own)
        tokens = out.new_token_ids[:-1] if stop_token else out.new_token_ids
        text = ""
        if seq.deferred:
            seq.detok.extend(tokens)  # decoded by the flush below, when it finished
        elif tokens:
            text = "".join([seq.detok.add(token) for token in tokens])
            if seq.stops is not None:
                text, hit = seq.stops.feed(text)
                if hit:
                    out.new_text, out.finish_reason, out.stop_str = text, FinishReason.STOP, seq.stops.matched
                    return True
        if out.finished:  # release text held back for a possible stop string or a partial character
            tail = seq.detok.flush()
            if seq.stops is not None:
                held, hit = seq.stops.feed(tail)
                text += held + ("" if hit else seq.stops.flush())
            else:
                text += tail
        out.new_text = text
        out.stop_str = seq.stops.matched if seq.stops is not None else None
        return False
