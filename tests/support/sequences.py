"""Hand-built training sequences and GRPO groups that the learner's tests share (one process in
tests/trainer/test_grpo_loss.py, several in test_distributed.py through distributed_step.py)."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

from recorder.trajectories import Span, TrainingSequence
from trainer.sample import Sample

LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}


EPISODES = itertools.count()


def sequence(
    rng: random.Random, turns: list[tuple[int, int]], truncated: bool = False, session: str | None = None
) -> TrainingSequence:
    """A multi-turn sequence: (context tokens, sampled tokens) per turn; an episode of its own
    unless `session` names one."""
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    spans = []
    for context, sampled in turns:
        ids += [rng.randrange(100, 5000) for _ in range(context)]
        mask += [0] * context
        logprobs += [0.0] * context
        spans.append(Span(len(ids), len(ids) + sampled, len(spans), "0", "0"))
        ids += [rng.randrange(100, 5000) for _ in range(sampled)]
        mask += [1] * sampled
        # A random model's logprobs are about -ln(vocabulary) = -10.8: near it, so that some
        # ratios are clipped and some not, and some sequences pass the importance caps.
        logprobs += [-10.8 + rng.uniform(-0.4, 0.4) for _ in range(sampled)]
    return TrainingSequence(session or f"episode-{next(EPISODES)}", 0, ids, mask, logprobs, spans, truncated)


def groups() -> list[Sample]:
    """Three GRPO groups: each group's rows share their prompt, then go their own ways (tool
    tokens inside, one truncated), and the groups' prompts differ in length (one is one token)."""
    rng = random.Random(11)
    samples = []
    shapes = [[(0, 5), (4, 3)], [(0, 7)], [(0, 2), (3, 6)]], [[(0, 4)], [(0, 8)], [(0, 3)]], [[(0, 3)], [(0, 6)]]
    for prompt_length, turns in zip((14, 9, 1), shapes, strict=True):  # a prompt of one token too
        prompt = [rng.randrange(100, 5000) for _ in range(prompt_length)]
        for n, shape in enumerate(turns):
            rest = sequence(rng, shape, truncated=n == 2)
            built = TrainingSequence(
                "s",
                0,
                prompt + rest.input_ids,
                [0] * prompt_length + rest.loss_mask,
                [0.0] * prompt_length + rest.logprobs,
                [replace(span, start=span.start + prompt_length, end=span.end + prompt_length) for span in rest.spans],
                rest.truncated,
            )
            samples.append(Sample(built, rng.uniform(-1, 1)))
    return samples


def cut_episode(seed: int = 11) -> tuple[TrainingSequence, list[TrainingSequence], Sample]:
    """An episode of 3 turns as 1 sequence and as 3 (each turn's sampled tokens trained after
    the whole context before them, as a subagent, compaction or fork would cut it), cut unequally
    (12, 2 and 2 sampled tokens: equal cuts hid that a row's mean weighed a short row's tokens
    more), and another episode of 1 sequence to stand beside it."""
    rng = random.Random(seed)
    whole = sequence(rng, [(10, 12), (5, 2), (6, 2)], session="cut")
    cuts = []
    for k, span in enumerate(whole.spans):
        mask = [int(span.start <= i < span.end) for i in range(span.end)]
        logprobs = [lp if m else 0.0 for lp, m in zip(whole.logprobs, mask, strict=False)]
        cuts.append(replace(whole, chain=k, input_ids=whole.input_ids[: span.end], loss_mask=mask, logprobs=logprobs))
    return whole, cuts, Sample(sequence(rng, [(8, 6)], session="other"), -0.8)
