"""A small continuous-batching scheduler for the benchmark's generation workload.

Each step it builds one *flattened token batch* (the layout of ``models.llama``): one
token for every running sequence (decode) followed by the whole prompt of every request
it admits this step (prefill), so ``T`` = decodes + admitted prompt tokens. A request
takes a KV-cache slot when admitted and gives it back the step it finishes; a freed slot
is reused from the next step on, never while its sequence still runs.

The schedule depends only on the requests' lengths, never on the sampled token values,
so :func:`plan` can dry-run it with dummy tokens to learn every step's ``T`` up front:
the benchmark uses that histogram to pick the sizes worth compiling, and the real run
then produces exactly the same sequence of batch sizes.
"""
from __future__ import annotations

import heapq
import random
from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Request:
    id: int
    prompt: tuple[int, ...]
    output_len: int
    """Tokens to generate; the first comes from the prefill step."""


def make_requests(
    num: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    seed: int = 0,
    output_spread: float = 0.25,
) -> list[Request]:
    """``num`` requests with random prompts of ``input_len`` tokens and output lengths drawn
    uniformly from ``output_len * (1 +- output_spread)`` (at least 1), all from ``seed``.

    Varying the output lengths makes sequences finish at different steps, so the decode
    batch shrinks and refills and the run meets batch sizes besides ``max_num_seqs``."""
    if num <= 0 or input_len <= 0 or output_len <= 0:
        raise ValueError(
            f"need positive requests, input_len and output_len, "
            f"got {num}, {input_len}, {output_len}"
        )
    if not 0 <= output_spread < 1:
        raise ValueError(f"output_spread must be in [0, 1), got {output_spread}")
    rng = random.Random(seed)
    spread = int(output_len * output_spread)
    return [
        Request(
            id=i,
            prompt=tuple(rng.randrange(vocab_size) for _ in range(input_len)),
            output_len=max(1, rng.randint(output_len - spread, output_len + spread)),
        )
        for i in range(num)
    ]


@dataclass
class Sequence:
    """A request that holds a slot: its generated tokens so far."""

    request: Request
    slot: int
    generated: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.request.output_len


@dataclass(frozen=True)
class Step:
    """One model call: the flattened batch and, per scheduled sequence, the index of its
    last token, whose logits give that sequence's next token."""

    sequences: tuple[Sequence, ...]
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    sample_indices: list[int]
    num_prefills: int

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


class Scheduler:
    """First come, first served: decodes first, then admit waiting requests while a slot
    is free and their prompt fits in ``max_num_batched_tokens`` (one prompt is admitted
    regardless when the batch would otherwise be empty, so long prompts still run).

    Drive it with ``step = schedule()`` / ``update(step, sampled)`` until ``schedule()``
    returns None; ``outputs`` then holds every request's generated tokens."""

    def __init__(self, requests: list[Request], max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_seqs <= 0 or max_num_batched_tokens <= 0:
            raise ValueError(
                f"need max_num_seqs > 0 and max_num_batched_tokens > 0, "
                f"got {max_num_seqs} and {max_num_batched_tokens}"
            )
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting = list(reversed(requests))  # pop() takes the oldest
        self.running: list[Sequence] = []
        self.free_slots = list(range(max_num_seqs))  # a min-heap: lowest slot first
        self.outputs: dict[int, list[int]] = {}

    def schedule(self) -> Step | None:
        sequences: list[Sequence] = []
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_indices: list[int] = []
        for seq in self.running:
            sequences.append(seq)
            input_ids.append(seq.generated[-1])
            # The prompt fills positions 0..len-1; generated token i sits at len + i.
            positions.append(len(seq.request.prompt) + len(seq.generated) - 1)
            slots.append(seq.slot)
            sample_indices.append(len(input_ids) - 1)
        num_prefills = 0
        while self.waiting and self.free_slots:
            prompt = self.waiting[-1].prompt
            if input_ids and len(input_ids) + len(prompt) > self.max_num_batched_tokens:
                break
            seq = Sequence(self.waiting.pop(), heapq.heappop(self.free_slots))
            sequences.append(seq)
            input_ids.extend(prompt)
            positions.extend(range(len(prompt)))
            slots.extend([seq.slot] * len(prompt))
            sample_indices.append(len(input_ids) - 1)
            num_prefills += 1
        if not sequences:
            return None
        return Step(tuple(sequences), input_ids, positions, slots, sample_indices, num_prefills)

    def update(self, step: Step, sampled: list[int]) -> None:
        """Append each sequence's sampled token (in ``step.sequences`` order); finished
        sequences leave and give their slot back for the next step."""
        if len(sampled) != len(step.sequences):
            raise ValueError(f"got {len(sampled)} tokens for {len(step.sequences)} sequences")
        running = []
        for seq, token in zip(step.sequences, sampled):
            seq.generated.append(token)
            if seq.done:
                self.outputs[seq.request.id] = seq.generated
                heapq.heappush(self.free_slots, seq.slot)
            else:
                running.append(seq)
        self.running = running


def plan(requests: list[Request], max_num_seqs: int, max_num_batched_tokens: int) -> list[Step]:
    """Every step of the schedule, from a dry run with dummy tokens (see the module
    docstring: the real run has the same steps, only other token values)."""
    scheduler = Scheduler(requests, max_num_seqs, max_num_batched_tokens)
    steps = []
    while (step := scheduler.schedule()) is not None:
        steps.append(step)
        scheduler.update(step, [0] * len(step.sequences))
    return steps


def size_histogram(steps: list[Step]) -> Counter[int]:
    """How many steps have each token count ``T``."""
    return Counter(step.num_tokens for step in steps)
